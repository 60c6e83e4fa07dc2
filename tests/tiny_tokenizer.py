"""Tiny tokenizers built on the fly for tests: no downloads, a few milliseconds each.

This file owns `build_tiny_tokenizer` (a byte-level BPE of any size, TINY_VOCAB_SIZE by default,
written as tokenizer.json + tokenizer_config.json the way a Hub checkpoint ships them), the chat
templates the tests render, and `build_llama2_style_tokenizer` (a SentencePiece-style BPE with
byte fallback, the layout of Llama-2 / Mistral-v0.1 tokenizer.json files). Model tests import it
to give tiny checkpoints a real tokenizer: pass the model's vocab_size and every id the tokenizer
produces is below it (ster_dist's `Tokenizer.vocab_size` reports the same number).

The byte-level pipeline is the Qwen2 one (NFC, the Qwen2 split regex, ByteLevel without its own
regex) and the config declares the generic PreTrainedTokenizerFast, so `transformers.AutoTokenizer`
tokenizes it exactly like ster_dist whatever model_type a config.json beside it names: the generic
class is used, except for qwen2, which Transformers rebuilds as Qwen2Tokenizer, this same pipeline
(below FULL_BYTE_VOCAB_SIZE that rebuild drops characters outside the alphabet where the file
writes <unk>).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# The default size: the 256 byte symbols, the special tokens and ~120 merges.
TINY_VOCAB_SIZE = 384

# Trained into the vocabulary at ids 0..5, in this order, and registered as special added tokens.
# pad 0, bos 1, eos 2 line up with tests/tiny_models.py's model configs; eos is the ChatML end of
# turn so generation stops where CHATML ends an assistant message.
TINY_SPECIAL_TOKENS = ("<pad>", "<s>", "<|im_end|>", "<|im_start|>", "</s>", "<|endoftext|>")

# Below this size not every byte fits: the tokenizer keeps a printable-ASCII alphabet and <unk>.
FULL_BYTE_VOCAB_SIZE = 256 + len(TINY_SPECIAL_TOKENS)
MIN_VOCAB_SIZE = len(TINY_SPECIAL_TOKENS) + 1 + 40

# Alphabet of the small (non-byte-complete) tokenizers, most useful first.
_SMALL_ALPHABET = (
    " \nabcdefghijklmnopqrstuvwxyz.,!?'0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    ':;-()"/_<>|[]{}=+*&%$#@~`^\t'
)

# The Qwen2 pre-tokenizer regex (transformers/models/qwen2/tokenization_qwen2.py).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for tests.",
    "You are a helpful assistant. Answer the question briefly.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time there was a little model that could generate text.",
    "user: tell me a story about dragons and knights in the castle",
    "assistant: the dragon slept while the knights counted their gold coins",
    "system: keep your answers short, kind and correct",
    "Numbers like 12345 and 67890 are split into single digits.",
    "Distributed inference shards the weights across many workers and devices.",
    "Tensor parallel attention splits heads; expert parallel layers route tokens.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "<html> & 'quotes' \"double\" — unicode: café, naïve, 日本語, emoji 🙂",
    "steering vectors nudge the residual stream toward a chosen direction",
    "capture the hidden states, decide on the next token, merge the results",
]

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The Llama-2 chat template as Meta shipped it: bos_token/eos_token variables, raise_exception.
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Multi-line, indented, without '-' on every tag: exercises trim_blocks/lstrip_blocks, loop
# controls (continue/break), namespace, tojson (no HTML escaping, non-ASCII kept, indent),
# dict(), `tools is none`, the {% generation %} tag and strftime_now (its length only, so the
# output is deterministic).
LOOPS_TOJSON = """{% set ns = namespace(turns=0, last_user='') %}
{% if tools is not none %}
TOOLS {{ tools | tojson }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] | tojson }}<|im_end|>
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if ns.turns > 4 %}
        {% break %}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% set ns.last_user = message['content'] %}
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{% endgeneration %}<|im_end|>
    {% else %}
{{ message['content'] }}<|im_end|>
    {% endif %}
    {% if message.meta is defined %}
META {{ message.meta | tojson(indent=2, sort_keys=true) }}
    {% endif %}
{% endfor %}
{{ dict(turns=ns.turns, last=ns.last_user) | tojson }}
YEARLEN {{ strftime_now('%Y') | length }}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def _byte_symbols() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the printable symbol ByteLevel writes for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(0xA1, 0xAC + 1))
        + list(range(0xAE, 0xFF + 1))
    )
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def _train_byte_level(vocab_size: int) -> Tokenizer:
    full = vocab_size >= FULL_BYTE_VOCAB_SIZE
    if not full and vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"tiny tokenizers need vocab_size >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    tok = Tokenizer(models.BPE() if full else models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = list(TINY_SPECIAL_TOKENS)
    corpus = _CORPUS
    if full:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        # Keep the most useful ASCII characters and leave about a fifth of the ids to merges;
        # every other byte encodes as <unk>.
        specials.append("<unk>")
        room = vocab_size - len(specials)
        chars = _SMALL_ALPHABET[: min(len(_SMALL_ALPHABET), room - max(4, room // 5))]
        symbols = _byte_symbols()
        alphabet = [symbols[ord(c)] for c in chars]
        corpus = ["".join(c for c in line if c in chars) for line in _CORPUS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    # A size beyond what the corpus merges reach is filled with reserved special tokens, the way
    # large Hub vocabularies pad theirs.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def build_tiny_tokenizer(
    directory: Path,
    chat_template: str | None = CHATML,
    *,
    vocab_size: int = TINY_VOCAB_SIZE,
    add_bos: bool = False,
    config: dict | None = None,
) -> None:
    """Write tokenizer.json and tokenizer_config.json: a byte-level BPE of exactly vocab_size ids.

    Ids 0..5 are TINY_SPECIAL_TOKENS: pad_token "<pad>" 0, bos_token "<s>" 1, eos_token
    "<|im_end|>" 2 (the ChatML end of turn), then <|im_start|>, </s>, <|endoftext|>. From
    FULL_BYTE_VOCAB_SIZE (262) ids up any text encodes; smaller sizes (down to MIN_VOCAB_SIZE)
    keep a printable-ASCII alphabet and encode other characters as "<unk>" (id 6).
    add_bos=True gives tokenizer.json a TemplateProcessing post-processor that prepends <s>, the
    way Llama-3 files do. `config` entries are merged into tokenizer_config.json last (a None
    value deletes the key). Deterministic: the same arguments write the same bytes.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = _train_byte_level(vocab_size)
    if add_bos:
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(directory / "tokenizer.json"))

    cfg: dict = {
        # The generic class: AutoTokenizer then uses tokenizer.json as written whatever the
        # config.json model_type (qwen2 aside, whose rebuild is this same pipeline).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    if vocab_size < FULL_BYTE_VOCAB_SIZE:
        cfg["unk_token"] = "<unk>"
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def build_llama2_style_tokenizer(
    directory: Path,
    chat_template: str | None = LLAMA2_CHAT,
    *,
    config: dict | None = None,
    model_type: str | None = None,
) -> None:
    """Write a SentencePiece-style BPE (▁ for spaces, <0xXX> byte fallback) like Llama-2's files.

    tokenizer.json carries the normalizer Llama-2 ships (Prepend ▁, Replace ' '→▁), a
    post-processor adding <s>, and tokenizer_class "LlamaTokenizerFast" in tokenizer_config.json.
    model_type, when given, writes a minimal config.json (Transformers picks the tokenizer class
    from it too).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 3 + 200,
        special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS + ["[INST] <<SYS>> [/INST] <</SYS>>"] * 3, trainer)
    # Byte pieces are ordinary vocabulary in SentencePiece files, not added tokens.
    tj = json.loads(tok.to_str())
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] in ("<unk>", "<s>", "</s>")]
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<s>", "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))

    cfg: dict = {
        "tokenizer_class": "LlamaTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    if model_type is not None:
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}))


__all__ = [
    "CHATML",
    "FULL_BYTE_VOCAB_SIZE",
    "LLAMA2_CHAT",
    "LOOPS_TOJSON",
    "MIN_VOCAB_SIZE",
    "TINY_SPECIAL_TOKENS",
    "TINY_VOCAB_SIZE",
    "build_llama2_style_tokenizer",
    "build_tiny_tokenizer",
]
