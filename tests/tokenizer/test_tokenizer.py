"""Tests for ster_dist.tokenizer: parity with transformers.AutoTokenizer on tiny tokenizers.

Every tokenizer is trained in milliseconds by tests/tiny_tokenizer.py into a tmp dir; each test
loads it with both ster_dist's Tokenizer and Transformers' AutoTokenizer and asserts the ids, texts
and rendered chats are identical. No network, CPU only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jinja2
import pytest

from ster_dist.errors import Refusal
from ster_dist.tokenizer import Tokenizer
from tests.tiny_tokenizer import (
    CHATML,
    FULL_BYTE_VOCAB_SIZE,
    LLAMA2_CHAT,
    LOOPS_TOJSON,
    TINY_SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    build_llama2_style_tokenizer,
    build_tiny_tokenizer,
)

transformers = pytest.importorskip("transformers")
# Transformers warns about class choices (LlamaTokenizer over a ByteLevel file): not our concern.
logging.getLogger("transformers").setLevel(logging.ERROR)


def hf(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


TEXTS = [
    "Hello world!",
    " leading space and  double  spaces",
    "The quick brown fox jumps over the lazy dog.",
    "",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "a <s> b </s> c<s>d",
    "café naïve 日本語 🙂 — unseen: Ωmega ∑ zebra",
    "numbers 12345 and 3.14159",
    "\n\n  tabs\tand\r\nnewlines  ",
    "[INST] <<SYS>>\nsys\n<</SYS>>\n\nhello [/INST] answer</s><s>[INST] next [/INST]",
    "it's don't I'm we've they're",
    "tokens <|tool|> <|img|>x<|a|> <|image|> <|extra|> singing",
]


# ---- tokenizer directories ---------------------------------------------------------------------


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False))


def _tiny(tmp: Path, **kwargs) -> Path:
    build_tiny_tokenizer(tmp, **kwargs)
    return tmp


def _variant(name: str, tmp: Path) -> Path:
    """Tokenizer directories covering the special-token and class-choice paths of Transformers 5."""
    if name == "bytelevel":
        return _tiny(tmp)
    if name == "bytelevel_bos_postprocessor":
        # TemplateProcessing adds <s>; Transformers 5 ignores the config's add_bos_token false.
        return _tiny(tmp, add_bos=True, config={"add_bos_token": False, "add_eos_token": True})
    if name == "bytelevel_declared_llama":
        # LlamaTokenizerFast declared over a ByteLevel tokenizer.json: loaded generically.
        return _tiny(tmp, add_bos=True, config={"tokenizer_class": "LlamaTokenizerFast"})
    if name == "bytelevel_extra_tokens":
        # "ing" is in the vocabulary but not an added token: naming it sep_token makes it one.
        # image_token is model-specific and new: it gets the next id. <|im_end|> gains lstrip/rstrip
        # through added_tokens_decoder; extra_special_tokens adds one more.
        return _tiny(
            tmp,
            config={
                "sep_token": "ing",
                "image_token": "<|image|>",
                "extra_special_tokens": ["<|tool|>"],
                "added_tokens_decoder": {
                    "2": {
                        "content": "<|im_end|>",
                        "lstrip": True,
                        "rstrip": True,
                        "normalized": False,
                        "single_word": False,
                        "special": True,
                    },
                },
                "bos_token": {
                    "__type": "AddedToken",
                    "content": "<s>",
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                    "special": True,
                },
            },
        )
    if name == "bytelevel_additional_special_tokens":
        # The pre-v5 name of extra_special_tokens; one is already an added token, one is new.
        return _tiny(tmp, config={"additional_special_tokens": ["<|im_start|>", "<|tool|>"]})
    if name == "bytelevel_named_extra_and_additional":
        # Gemma-3 style: extra_special_tokens as a dict of named tokens, plus an old-style list.
        return _tiny(
            tmp,
            config={
                "extra_special_tokens": {"image_token": "<|img|>", "boi_token": "<s>"},
                "additional_special_tokens": ["<|a|>"],
            },
        )
    if name == "bytelevel_special_tokens_map":
        # No added_tokens_decoder: the legacy special_tokens_map.json overrides the config.
        build_tiny_tokenizer(tmp)
        _write_json(
            tmp / "special_tokens_map.json",
            {
                "eos_token": {
                    "content": "</s>",
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                },
                "additional_special_tokens": ["<|extra|>"],
            },
        )
        return tmp
    if name == "bytelevel_split_special":
        return _tiny(tmp, config={"split_special_tokens": True})
    if name == "llama2":
        build_llama2_style_tokenizer(tmp)
        return tmp
    if name == "llama2_legacy":
        build_llama2_style_tokenizer(tmp, config={"legacy": True})
        return tmp
    if name == "llama2_no_prefix_space":
        build_llama2_style_tokenizer(tmp, config={"add_prefix_space": False})
        return tmp
    if name == "llama2_model_type_llama":
        build_llama2_style_tokenizer(tmp, model_type="llama")
        return tmp
    if name == "llama2_model_type_mistral":
        # mistral registers the generic class, which beats the declared LlamaTokenizer.
        build_llama2_style_tokenizer(tmp, model_type="mistral")
        return tmp
    if name == "llama2_no_added_tokens_decoder_defaults":
        # No special tokens in the config: LlamaTokenizer's defaults <unk>, <s>, </s> apply.
        build_llama2_style_tokenizer(
            tmp, config={"bos_token": None, "eos_token": None, "unk_token": None}
        )
        return tmp
    if name == "gpt_neox":
        # GPTNeoXTokenizer drops tokenizer.json's BOS post-processor, defaults pad to <|padding|>.
        build_tiny_tokenizer(
            tmp, add_bos=True, config={"tokenizer_class": "GPTNeoXTokenizer", "pad_token": None}
        )
        _write_json(tmp / "config.json", {"model_type": "gpt_neox"})
        return tmp
    if name == "qwen2_model_type":
        # qwen2 is a known-wrong Hub class: Transformers rebuilds it as Qwen2Tokenizer, the same
        # pipeline as the tiny tokenizer's; its default unk <|endoftext|> applies.
        build_tiny_tokenizer(tmp)
        _write_json(tmp / "config.json", {"model_type": "qwen2"})
        return tmp
    raise AssertionError(name)


VARIANTS = [
    "bytelevel",
    "bytelevel_bos_postprocessor",
    "bytelevel_declared_llama",
    "bytelevel_extra_tokens",
    "bytelevel_additional_special_tokens",
    "bytelevel_named_extra_and_additional",
    "bytelevel_special_tokens_map",
    "bytelevel_split_special",
    "llama2",
    "llama2_legacy",
    "llama2_no_prefix_space",
    "llama2_model_type_llama",
    "llama2_model_type_mistral",
    "llama2_no_added_tokens_decoder_defaults",
    "gpt_neox",
    "qwen2_model_type",
]


# ---- the builder -------------------------------------------------------------------------------


def test_tiny_tokenizer_builder(tmp_path):
    build_tiny_tokenizer(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "tokenizer_config.json"}
    tok = Tokenizer.from_directory(tmp_path)
    assert tok.vocab_size == TINY_VOCAB_SIZE == len(hf(tmp_path))
    assert [tok.token_to_id(t) for t in TINY_SPECIAL_TOKENS] == list(
        range(len(TINY_SPECIAL_TOKENS))
    )
    assert tok.token_to_id("definitely-not-a-token") is None
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", "<|im_end|>")
    assert tok.has_chat_template and tok.chat_template == CHATML
    # Byte-level: any text round-trips.
    text = "zebra Ωmega ∑ 🙂\x00\ttab"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < tok.vocab_size


ASCII_TEXTS = [
    "Hello world! The quick brown fox.",
    " leading space, 12345 and 'quotes'\n\nnew lines",
    "<|im_start|>user\nhi there<|im_end|>\n<s>x</s>",
]


@pytest.mark.parametrize("vocab_size", [53, 97, 200, FULL_BYTE_VOCAB_SIZE, 384, 700])
def test_tiny_tokenizer_sizes(vocab_size, tmp_path):
    build_tiny_tokenizer(tmp_path, vocab_size=vocab_size)
    tok, theirs = Tokenizer.from_directory(tmp_path), hf(tmp_path)
    assert tok.vocab_size == vocab_size == len(theirs)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    texts = TEXTS if vocab_size >= FULL_BYTE_VOCAB_SIZE else ASCII_TEXTS
    for text in texts:
        ids = tok.encode(text)
        assert ids == theirs(text)["input_ids"]
        assert max(ids, default=0) < vocab_size
        if vocab_size >= FULL_BYTE_VOCAB_SIZE:
            assert tok.decode(ids, skip_special_tokens=False) == text
    # Even the smallest alphabet holds lowercase letters, digits, space, newline and .,!?'
    lowercase = "hello world, 12 times!\nthe quick brown fox's tale?"
    assert tok.decode(tok.encode(lowercase)) == lowercase
    if vocab_size < FULL_BYTE_VOCAB_SIZE:
        assert tok.unk_token_id == 6 and tok.unk_token_id in tok.encode("é")


@pytest.mark.parametrize("vocab_size", [97, 384])
@pytest.mark.parametrize(
    "model_type", ["llama", "qwen2", "qwen3", "gemma", "gpt2", "gpt_neox", "phi3", "cohere"]
)
def test_tiny_tokenizer_beside_model_configs(model_type, vocab_size, tmp_path):
    # tests/tiny_models.py writes a config.json beside the tokenizer: whatever class Transformers
    # picks from its model_type, it must tokenize like ster_dist.
    build_tiny_tokenizer(tmp_path, vocab_size=vocab_size)
    _write_json(tmp_path / "config.json", {"model_type": model_type})
    tok, theirs = Tokenizer.from_directory(tmp_path), hf(tmp_path)
    assert tok.backend_class == type(theirs).__name__
    for text in ASCII_TEXTS:
        assert tok.encode(text) == theirs(text)["input_ids"]
    assert_chat_parity(tmp_path, M_SYSTEM, True)


def test_tiny_tokenizer_builder_is_deterministic(tmp_path):
    build_tiny_tokenizer(tmp_path / "a")
    build_tiny_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_text()


# ---- encode / decode parity ------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_decode_match_transformers(variant, tmp_path):
    directory = _variant(variant, tmp_path)
    ours, theirs = Tokenizer.from_directory(directory), hf(directory)

    assert ours.backend_class == type(theirs).__name__
    assert ours.vocab_size == len(theirs)
    assert ours.special_tokens_map == theirs.special_tokens_map
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert sorted(ours.all_special_ids) == sorted(
        i for i, t in theirs.added_tokens_decoder.items() if t.special
    )

    for text in TEXTS:
        expected = theirs(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert (
            ours.encode(text, add_special_tokens=False)
            == theirs(text, add_special_tokens=False)["input_ids"]
        )
        for skip in (True, False):
            assert ours.decode(expected, skip_special_tokens=skip) == theirs.decode(
                expected, skip_special_tokens=skip
            ), (text, skip)
    assert ours.encode_batch(TEXTS) == theirs(TEXTS)["input_ids"]
    assert (
        ours.encode_batch(TEXTS, add_special_tokens=False)
        == theirs(TEXTS, add_special_tokens=False)["input_ids"]
    )
    every_id = list(range(ours.vocab_size))
    assert ours.decode(every_id, skip_special_tokens=True) == theirs.decode(
        every_id, skip_special_tokens=True
    )
    assert ours.decode(every_id, skip_special_tokens=False) == theirs.decode(
        every_id, skip_special_tokens=False
    )
    for token in (
        "<s>",
        "</s>",
        "<|im_end|>",
        "<|image|>",
        "<|img|>",
        "<|a|>",
        "<|tool|>",
        "ing",
        "▁the",
        "nope",
    ):
        assert ours.token_to_id(token) == theirs.convert_tokens_to_ids(token) or (
            ours.token_to_id(token) is None
            and theirs.convert_tokens_to_ids(token) == theirs.unk_token_id
        )


def test_llama_rebuild_differs_from_raw_tokenizer_json(tmp_path):
    # Why the LlamaTokenizer rebuild exists: tokenizer.json's Prepend normalizer puts "▁" after
    # every special token; Transformers 5 (legacy=False) does not. ster_dist follows Transformers.
    from tokenizers import Tokenizer as Raw

    build_llama2_style_tokenizer(tmp_path)
    text = "<s>[INST] hi [/INST]"
    raw = Raw.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids
    ours = Tokenizer.from_directory(tmp_path).encode(text)
    assert ours == hf(tmp_path)(text)["input_ids"]
    assert ours != raw


def test_bos_post_processor_decides_special_tokens(tmp_path):
    _tiny(tmp_path, add_bos=True, config={"add_bos_token": False})
    tok = Tokenizer.from_directory(tmp_path)
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id
    assert tok.decode(tok.encode("hi")) == "hi"
    assert tok.decode(tok.encode("hi"), skip_special_tokens=False) == "<s>hi"


# ---- chat templates ----------------------------------------------------------------------------

M_USER = [{"role": "user", "content": "Hello!"}]
M_SYSTEM = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And Germany?"},
]
M_ODD = [
    {"role": "user", "content": "<html> & 'quotes' \"double\" café 🙂 <|im_end|>", "name": None},
    {
        "role": "assistant",
        "content": "  spaced answer  ",
        "tool_calls": None,
        "reasoning_content": "think",
    },
]
M_LONG = [
    {"role": "system", "content": "Sys </s> with tokens"},
    *[
        {
            "role": role,
            "content": f"turn {i}",
            **({"meta": {"b": i, "a": [1, "x"]}} if i == 1 else {}),
        }
        for i, role in enumerate(["user", "assistant"] * 3)
    ],
]
MESSAGE_LISTS = {"user": M_USER, "system": M_SYSTEM, "odd": M_ODD, "long": M_LONG}


def assert_chat_parity(directory: Path, messages, add_generation_prompt: bool, **kwargs) -> None:
    ours, theirs = Tokenizer.from_directory(directory), hf(directory)
    text = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert ours.render_chat(messages, add_generation_prompt, **kwargs) == text
    ids = theirs.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    assert ours.apply_chat_template(messages, add_generation_prompt, **kwargs) == ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", list(MESSAGE_LISTS), ids=list(MESSAGE_LISTS))
@pytest.mark.parametrize("template", ["chatml", "loops_tojson"])
def test_chat_templates_match_transformers(template, messages, add_generation_prompt, tmp_path):
    source = {"chatml": CHATML, "loops_tojson": LOOPS_TOJSON}[template]
    _tiny(tmp_path, chat_template=source)
    assert_chat_parity(tmp_path, MESSAGE_LISTS[messages], add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", ["user", "system"])
@pytest.mark.parametrize(
    "variant", ["llama2", "llama2_legacy", "llama2_model_type_mistral", "bytelevel_bos"]
)
def test_llama2_template_matches_transformers(variant, messages, add_generation_prompt, tmp_path):
    if variant == "bytelevel_bos":
        _tiny(tmp_path, chat_template=LLAMA2_CHAT, add_bos=True, config={"eos_token": "</s>"})
    else:
        _variant(variant, tmp_path)
    assert_chat_parity(tmp_path, MESSAGE_LISTS[messages], add_generation_prompt)


def test_template_sees_tools_documents_and_kwargs(tmp_path):
    _tiny(tmp_path, chat_template=LOOPS_TOJSON)
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>&</b> ünïcode"}}]
    assert_chat_parity(tmp_path, M_USER, True, tools=tools)
    kw_template = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|"
    kw_template += "{{ enable_thinking }}|{{ messages|length }}"
    _tiny(tmp_path, chat_template=kw_template)
    assert_chat_parity(tmp_path, M_USER, True, enable_thinking=False)
    assert_chat_parity(tmp_path, M_USER, True, bos_token="OVERRIDDEN")
    assert (
        Tokenizer.from_directory(tmp_path).render_chat(M_USER, enable_thinking=False)
        == "<s>|<|im_end|>|<pad>|False|1"
    )


def test_raise_exception_is_a_refusal_with_the_templates_message(tmp_path):
    _variant("llama2", tmp_path)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.exceptions.TemplateError) as theirs:
        hf(tmp_path).apply_chat_template(bad, tokenize=False)
    with pytest.raises(Refusal) as ours:
        Tokenizer.from_directory(tmp_path).render_chat(bad)
    assert str(theirs.value) in str(ours.value)
    assert "Conversation roles must alternate" in str(ours.value)


def test_namespace_refuses_underscore_attributes(tmp_path):
    _tiny(tmp_path, chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(Refusal, match="underscore"):
        Tokenizer.from_directory(tmp_path).render_chat(M_USER)


def test_sandbox_blocks_attribute_escapes(tmp_path):
    _tiny(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(Refusal):
        Tokenizer.from_directory(tmp_path).render_chat(M_USER)


def test_strftime_now(tmp_path):
    from datetime import datetime

    _tiny(tmp_path, chat_template="{{ strftime_now('%Y') }}")
    assert Tokenizer.from_directory(tmp_path).render_chat(M_USER) in {
        str(datetime.now().year - 1),
        str(datetime.now().year),
    }


# ---- where templates come from ------------------------------------------------------------------


def test_template_list_in_config_uses_default(tmp_path):
    _tiny(
        tmp_path,
        chat_template=[
            {"name": "tool_use", "template": "TOOLS{{ messages[0]['content'] }}"},
            {"name": "default", "template": CHATML},
        ],
    )
    tok = Tokenizer.from_directory(tmp_path)
    assert tok.chat_template == CHATML and set(tok.chat_templates) == {"default", "tool_use"}
    assert_chat_parity(tmp_path, M_SYSTEM, True)


def test_template_list_without_default_is_refused(tmp_path):
    _tiny(tmp_path, chat_template=[{"name": "tool_use", "template": "x"}])
    tok = Tokenizer.from_directory(tmp_path)
    with pytest.raises(Refusal, match="none named 'default'.*tool_use"):
        tok.render_chat(M_USER)
    with pytest.raises(ValueError):
        hf(tmp_path).apply_chat_template(M_USER, tokenize=False)


def test_chat_template_jinja_file_wins_over_config(tmp_path):
    _tiny(tmp_path, chat_template="CONFIG TEMPLATE")
    (tmp_path / "chat_template.jinja").write_text(LLAMA2_CHAT)
    assert Tokenizer.from_directory(tmp_path).chat_template == LLAMA2_CHAT
    assert_chat_parity(tmp_path, M_SYSTEM, False)


def test_additional_chat_templates_directory(tmp_path):
    _tiny(tmp_path, chat_template="CONFIG TEMPLATE")
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "rag.jinja").write_text("RAG {{ messages|length }}")
    tok = Tokenizer.from_directory(tmp_path)
    assert tok.chat_template == CHATML and set(tok.chat_templates) == {"default", "rag"}
    assert_chat_parity(tmp_path, M_SYSTEM, True)


def test_saved_by_transformers_round_trip(tmp_path):
    # Transformers 5 saves the template as chat_template.jinja; ster_dist reads what it saved.
    _tiny(tmp_path / "src", chat_template=LOOPS_TOJSON, add_bos=True)
    hf(tmp_path / "src").save_pretrained(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "chat_template.jinja").is_file()
    assert_chat_parity(tmp_path / "saved", M_LONG, True)
    ours = Tokenizer.from_directory(tmp_path / "saved")
    for text in TEXTS:
        assert ours.encode(text) == hf(tmp_path / "saved")(text)["input_ids"]


def test_chat_template_json_is_the_last_resort(tmp_path):
    _tiny(tmp_path, chat_template=None)
    _write_json(tmp_path / "chat_template.json", {"chat_template": CHATML})
    tok = Tokenizer.from_directory(tmp_path)
    assert tok.chat_template == CHATML
    assert tok.chat_template_source.endswith("chat_template.json")
    # AutoTokenizer ignores that (processor) file; rendering the same template matches it.
    assert hf(tmp_path).chat_template is None
    assert tok.render_chat(M_USER) == hf(tmp_path).apply_chat_template(
        M_USER, chat_template=CHATML, tokenize=False, add_generation_prompt=True
    )


def test_plain_dict_special_tokens(tmp_path):
    _tiny(
        tmp_path,
        config={"bos_token": {"content": "<s>"}, "eos_token": {"content": "</s>", "special": True}},
    )
    tok = Tokenizer.from_directory(tmp_path)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 4)


def test_remote_code_is_ignored(tmp_path):
    _tiny(tmp_path, config={"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}})
    (tmp_path / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    tok = Tokenizer.from_directory(tmp_path)
    assert tok.decode(tok.encode("hello")) == "hello"


# ---- prompt_ids ----------------------------------------------------------------------------------


def test_prompt_ids_modes(tmp_path):
    _tiny(tmp_path / "chat", add_bos=True)
    chat = Tokenizer.from_directory(tmp_path / "chat")
    user = [{"role": "user", "content": "hi"}]
    with_system = [{"role": "system", "content": "be brief"}, *user]
    assert chat.prompt_ids("hi", None, "auto") == chat.apply_chat_template(user, True)
    assert chat.prompt_ids("hi", None, "on") == chat.apply_chat_template(user, True)
    assert chat.prompt_ids("hi", "be brief", "auto") == chat.apply_chat_template(with_system, True)
    assert (
        chat.prompt_ids("hi", None, "off")
        == chat.encode("hi")
        == [chat.bos_token_id, *chat.encode("hi", False)]
    )
    theirs = hf(tmp_path / "chat")
    assert chat.prompt_ids("hi", "be brief", "on") == theirs.apply_chat_template(
        with_system, tokenize=True, return_dict=False, add_generation_prompt=True
    )

    _tiny(tmp_path / "plain", chat_template=None, add_bos=True)
    plain = Tokenizer.from_directory(tmp_path / "plain")
    assert not plain.has_chat_template
    assert plain.prompt_ids("hi", None, "auto") == theirs("hi")["input_ids"]
    with pytest.raises(Refusal, match="no chat template.*off"):
        plain.prompt_ids("hi", None, "on")
    with pytest.raises(Refusal, match="system prompt"):
        plain.prompt_ids("hi", "be brief", "auto")
    with pytest.raises(Refusal, match="system prompt.*--chat-template auto"):
        chat.prompt_ids("hi", "be brief", "off")
    with pytest.raises(Refusal, match="one of auto, on, off"):
        chat.prompt_ids("hi", None, "yes")


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    ['{"version": "1.0", "model": {"type": "BPE"', '{"model": 3}', "\xff\xfe not json", "[]"],
    ids=["truncated", "not-a-tokenizer", "garbage", "array"],
)
def test_corrupt_tokenizer_json_is_refused(content, tmp_path):
    build_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(Refusal) as err:
        Tokenizer.from_directory(tmp_path)
    message = str(err.value)
    assert message.startswith(f"failed to load tokenizer {tmp_path / 'tokenizer.json'}: ")
    assert "\n" not in message and len(message) > len(
        f"failed to load tokenizer {tmp_path}/tokenizer.json: "
    )


def test_missing_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(Refusal, match="failed to load tokenizer .*tokenizer.json: file not found"):
        Tokenizer.from_directory(tmp_path)


def test_corrupt_tokenizer_config_is_refused(tmp_path):
    build_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(Refusal, match="failed to read tokenizer config .*tokenizer_config.json"):
        Tokenizer.from_directory(tmp_path)


def test_template_syntax_error_is_refused_when_used(tmp_path):
    _tiny(tmp_path, chat_template="{% for m in messages %}{{ m.content }")
    tok = Tokenizer.from_directory(tmp_path)  # loading does not need the template
    assert tok.prompt_ids("hi", None, "off") == tok.encode("hi")
    with pytest.raises(Refusal, match="does not parse"):
        tok.prompt_ids("hi", None, "auto")


def test_messages_must_be_dicts(tmp_path):
    tok = Tokenizer.from_directory(_tiny(tmp_path))
    with pytest.raises(Refusal, match="dicts"):
        tok.render_chat(["hello"])
    with pytest.raises(Refusal, match="list"):
        tok.render_chat({"role": "user", "content": "x"})


# ---- the class-choice tables track the installed Transformers ----------------------------------


def test_class_tables_match_installed_transformers():
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    from ster_dist.families.names import FAMILY_NAMES
    from ster_dist.tokenizer.classes import INCORRECT_HUB_CLASS, REGISTERED_CLASS

    try:
        import mistral_common  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip(
            "mistral_common installed: Transformers maps Mistral types to MistralCommonBackend"
        )
    expected = {
        f: TOKENIZER_MAPPING_NAMES[f] for f in FAMILY_NAMES if TOKENIZER_MAPPING_NAMES.get(f)
    }
    assert REGISTERED_CLASS == expected
    assert INCORRECT_HUB_CLASS == set(FAMILY_NAMES) & set(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
