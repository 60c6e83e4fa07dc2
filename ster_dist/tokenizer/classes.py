"""Which tokenizer class Transformers 5's `AutoTokenizer` builds for a checkpoint, and the two
classes whose pipeline differs from what tokenizer.json describes, rebuilt as they build it.

LlamaTokenizer (SentencePiece-style files: a Metaspace pre-tokenizer with prepend_scheme "first"
unless legacy=true, so text after a special token gets no "▁") and GPTNeoXTokenizer
(tokenizer.json's post-processor dropped: no BOS/EOS) rebuild the pipeline. Every other class
Transformers picks (GPT2Tokenizer, Qwen2Tokenizer, GemmaTokenizer, CohereTokenizer...) rebuilds the
pipeline its tokenizer.json already describes; only its constructor's default special tokens
(CLASS_DEFAULT_TOKENS) apply. tokenizer.py reads the files and asks this module what to build.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer as _BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

# Classes Transformers treats as "no model-specific tokenizer": tokenizer.json is used as saved.
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizer", "PythonBackend", ""})

# TOKENIZER_MAPPING_NAMES (transformers 5.24, mistral_common not installed) for ster_dist's
# families that register a tokenizer class. A model_type absent here registers none.
# tests/tokenizer/test_tokenizer.py checks this table against the installed Transformers.
REGISTERED_CLASS: dict[str, str] = {
    **dict.fromkeys(
        (
            "mistral",
            "mixtral",
            "phi3",
            "granite",
            "granitemoe",
            "stablelm",
            "nemotron",
            "olmo2",
            "olmo3",
            "internlm3",
            "ernie4_5",
            "glm",
            "glm4",
            "gpt_bigcode",
            "minicpm3",
            "glm4_moe",
            "internlm2",
            "jamba",
            "ernie4_5_moe",
            "phimoe",
            "granitemoehybrid",
            "kimi_linear",
            "minimax_m2",
            "flex_olmo",
            "granitemoeshared",
            "glm4_moe_lite",
            "iquestcoder",
            "hyperclovax",
            "olmo_hybrid",
            "mimo_v2_flash",
            "ministral3",
        ),
        "TokenizersBackend",
    ),
    **dict.fromkeys(
        ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "dots3_note"), "Qwen2Tokenizer"
    ),
    **dict.fromkeys(("qwen3_5_text", "qwen3_5_moe_text"), "Qwen3_5Tokenizer"),
    **dict.fromkeys(("phi", "starcoder2", "gptj", "gpt2", "opt", "dbrx", "jais2"), "GPT2Tokenizer"),
    **dict.fromkeys(
        ("olmo", "olmoe", "gpt_neox", "mpt", "mamba", "falcon_mamba", "mamba2"), "GPTNeoXTokenizer"
    ),
    **dict.fromkeys(("cohere", "cohere2"), "CohereTokenizer"),
    **dict.fromkeys(("gemma", "gemma2", "gemma3_text", "gemma3n_text"), "GemmaTokenizer"),
}

# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS ∩ ster_dist's families: the registered class wins over
# the tokenizer_class the checkpoint declares.
INCORRECT_HUB_CLASS = frozenset(
    {
        "ernie4_5",
        "ernie4_5_moe",
        "hyperclovax",
        "internlm2",
        "internlm3",
        "iquestcoder",
        "jamba",
        "minicpm3",
        "minimax_m2",
        "nemotron",
        "phi3",
        "phimoe",
        "qwen2",
        "qwen3_5_moe_text",
    }
)

# Constructor defaults of the model-specific classes: they apply when the config omits the key.
CLASS_DEFAULT_TOKENS: dict[str, dict[str, str]] = {
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "GPTNeoXTokenizer": {
        "unk_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|padding|>",
    },
    "GPT2Tokenizer": {
        "unk_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
    },
    "Qwen2Tokenizer": {
        "unk_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    },
    "Qwen3_5Tokenizer": {
        "unk_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    },
    "GemmaTokenizer": {
        "unk_token": "<unk>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    },
    "CohereTokenizer": {
        "unk_token": "<UNK>",
        "bos_token": "<BOS_TOKEN>",
        "eos_token": "<|END_OF_TURN_TOKEN|>",
        "pad_token": "<PAD>",
        "cls_token": "<CLS>",
        "sep_token": "<SEP>",
        "mask_token": "<MASK_TOKEN>",
    },
}


def _strip_fast(name: str | None) -> str:
    if not name:
        return ""
    if name == "PreTrainedTokenizerFast":
        return "TokenizersBackend"  # an alias of TokenizersBackend in Transformers 5
    return name.removesuffix("Fast")


def resolve_class(tokenizer_config: dict, model_config: dict, tokenizer_json_text: str) -> str:
    """The tokenizer class `AutoTokenizer.from_pretrained` builds, for the cases that matter here.

    Mirrors models/auto/tokenization_auto.py: a declared LlamaTokenizer over a ByteLevel
    tokenizer.json loads generically; a model_type whose registered class differs from the
    declared one uses the registered class when it is model-specific (and either the declared
    class or, for known-wrong Hub configs, the registered one); otherwise the declared class, then
    config.json's tokenizer_class, then the registered class.
    """
    model_type = model_config.get("model_type") or None
    declared = tokenizer_config.get("tokenizer_class") or model_config.get("tokenizer_class")
    registered = REGISTERED_CLASS.get(model_type) if model_type else None
    if (
        _strip_fast(declared) == "LlamaTokenizer"
        and model_type not in INCORRECT_HUB_CLASS
        and '"ByteLevel"' in tokenizer_json_text
    ):
        return "TokenizersBackend"
    if declared and registered and _strip_fast(registered) != _strip_fast(declared):
        if _strip_fast(registered) not in _GENERIC_CLASSES:
            name = registered if model_type in INCORRECT_HUB_CLASS else declared
            if _strip_fast(name) not in _GENERIC_CLASSES:
                return _strip_fast(name)
        return "TokenizersBackend"
    for name in (
        tokenizer_config.get("tokenizer_class"),
        model_config.get("tokenizer_class"),
        registered,
    ):
        if name:
            stripped = _strip_fast(name)
            return "TokenizersBackend" if stripped in _GENERIC_CLASSES else stripped
    return "TokenizersBackend"


def _bpe_parts(tokenizer_json: dict) -> tuple[dict[str, int], list[tuple[str, str]]] | None:
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []
    ]
    return dict(model["vocab"]), merges


def _rebuild_llama(tokenizer_json: dict, config: dict) -> _BackendTokenizer | None:
    """LlamaTokenizer.__init__ (models/llama/tokenization_llama.py) over tokenizer.json's BPE."""
    parts = _bpe_parts(tokenizer_json)
    if parts is None:
        return None  # not a BPE file: Transformers would mangle it; keep tokenizer.json as is
    vocab, merges = parts
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    legacy = bool(config.get("legacy", False))
    # _get_prepend_scheme: "first" prepends ▁ to the start of the text only, not after added tokens.
    prepend_scheme = ("first" if not legacy else "always") if add_prefix_space else "never"
    tok = _BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=prepend_scheme, split=False
    )
    sequence = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        sequence.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(sequence)
    return tok


def _rebuild_gpt_neox(tokenizer_json: dict, config: dict) -> _BackendTokenizer | None:
    """GPTNeoXTokenizer.__init__ (transformers/models/gpt_neox/tokenization_gpt_neox.py)."""
    parts = _bpe_parts(tokenizer_json)
    if parts is None:
        return None
    vocab, merges = parts
    add_prefix_space = bool(config.get("add_prefix_space") or False)
    trim_offsets = config.get("trim_offsets")
    trim_offsets = True if trim_offsets is None else bool(trim_offsets)
    tok = _BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=add_prefix_space, trim_offsets=trim_offsets
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def rebuilt(
    backend_class: str, tokenizer_json_text: str, config: dict, backend: _BackendTokenizer
) -> _BackendTokenizer:
    """tokenizer.json's pipeline as `backend_class` rebuilds it (the same pipeline for every class
    but two)."""
    if backend_class not in ("LlamaTokenizer", "GPTNeoXTokenizer"):
        return backend
    rebuild = _rebuild_llama if backend_class == "LlamaTokenizer" else _rebuild_gpt_neox
    # The classes rebuild from tokenizer.json's vocabulary and merges (the Rust parser accepted the
    # file, so it
    # is a JSON object).
    out = rebuild(json.loads(tokenizer_json_text), config)
    if out is None:
        return backend
    # The class keeps tokenizer.json's post-processor, except GPTNeoX, whose update_post_processor()
    # (add_bos /
    # add_eos dropped with a tokenizer.json present) writes one adding nothing.
    out.post_processor = backend.post_processor
    if backend_class == "GPTNeoXTokenizer":
        out.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
    return out
