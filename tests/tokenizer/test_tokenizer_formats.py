"""Tokenizers published as tiktoken rank files (ster_dist/tokenizer_files.py): Kimi's tiktoken.model
(TikTokenTokenizer) and GLM-4's tokenizer.model (ChatGLM4Tokenizer), made here by tiktoken's own BPE
trainer, against Transformers' TikTokenConverter over the same file and the class's pattern, and
against tiktoken itself: ids, decoded text and chat template renders. Then a Kimi-K2 checkpoint
(model_type kimi_k2, read as deepseek_v3) with such a tokenizer, whose `ster generate` answer
through its chat template equals Transformers' greedy output. Resolution takes the rank file its
class reads and refuses every other tokenizer file by name.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from ster_dist.errors import Refusal
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from ster_dist.tokenizer.files import TIKTOKEN_CLASSES
from tests.cli_run import cli_generate
from tests.hub_server import config_json, safetensors_bytes, serving
from tests.tiny.deepseek import TINY as DEEPSEEK_TINY
from tests.tiny_models import BASE_CONFIG
from tests.tiny_tokenizer import build_tiny_tokenizer

tiktoken = pytest.importorskip("tiktoken")
from tiktoken._educational import bpe_train  # noqa: E402  (tiktoken's reference trainer)

KIMI, GLM4 = TIKTOKEN_CLASSES["TikTokenTokenizer"], TIKTOKEN_CLASSES["ChatGLM4Tokenizer"]
CORPUS = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")[:6000] + (
    " 中文字符测试 汉字 Hello WORLD it's DON'T CamelCase 12345 ÿ€ café naïve"
)
MERGES = 120
TEXTS = [
    CORPUS[:2000],
    "Hello, world! 中文 it's 123456 DON'T\n\n  x  y\tz",
    "ÿ€😀 mixed CASEword CamelCase's 汉字abc",
    "text with <|im_end|> inside and [EOS] too",
]
CHAT = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
GLM_CHAT = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 中文? it's DON'T"},
]


def _entry(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    # trained with the cl100k split: Python's `regex` reads Kimi's class intersections (&&)
    # otherwise than
    # tiktoken's Rust engine, and any split trains a valid rank file
    return bpe_train(CORPUS, 256 + MERGES, GLM4.pattern, visualise=None)


def _write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    path.write_text(
        "".join(
            f"{base64.b64encode(t).decode()} {r}\n"
            for t, r in sorted(ranks.items(), key=lambda x: x[1])
        )
    )


def write_kimi(directory: Path, ranks: dict[bytes, int]) -> Path:
    """Kimi-K2's tokenizer files: tiktoken.model, and a config naming some of the 256 special
    ids."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_ranks(directory / "tiktoken.model", ranks)
    base = len(ranks)
    named = [
        "[BOS]",
        "[EOS]",
        "<|im_end|>",
        "<|im_user|>",
        "<|im_assistant|>",
        None,
        "<|start_header_id|>",
        "<|end_header_id|>",
        None,
        "[EOT]",
        "<|im_system|>",
        "<|im_middle|>",
    ]
    added = {str(base + i): _entry(t) for i, t in enumerate(named) if t is not None}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[EOS]",
        "added_tokens_decoder": added,
        "chat_template": CHAT,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_glm4(directory: Path, ranks: dict[bytes, int]) -> Path:
    """GLM-4's tokenizer files: tokenizer.model (tiktoken ranks) and its special tokens after
    them."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_ranks(directory / "tokenizer.model", ranks)
    specials = [
        "<|endoftext|>",
        "[MASK]",
        "[gMASK]",
        "[sMASK]",
        "<sop>",
        "<eop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
    ]
    config = {
        "tokenizer_class": "ChatGLM4Tokenizer",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(len(ranks) + i): _entry(t) for i, t in enumerate(specials)},
        "chat_template": GLM_CHAT,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def transformers_reference(
    directory: Path, kind, specials: list[str], prefix: tuple[str, ...] = ()
):
    """Transformers' tokenizer over the same rank file: TikTokenConverter with the class's pattern
    and special tokens, the config's named tokens and chat template."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    config = json.loads((directory / "tokenizer_config.json").read_text())
    backend = TikTokenConverter(
        str(directory / kind.file), pattern=kind.pattern, extra_special_tokens=specials
    ).converted()
    if prefix:  # ChatGLM4Tokenizer.build_inputs_with_special_tokens
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*prefix, "$A"]),
            special_tokens=[(t, backend.token_to_id(t)) for t in prefix],
        )
    named = {k: config[k] for k in ("bos_token", "eos_token", "pad_token") if k in config}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **named)
    tok.chat_template = config["chat_template"]
    return tok


def _kimi_specials(ranks, directory) -> list[str]:
    added = json.loads((directory / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    base = len(ranks)
    return [
        added[str(i)]["content"] if str(i) in added else f"<|reserved_token_{i}|>"
        for i in range(base, base + 256)
    ]


def test_kimi_tiktoken_matches_transformers_and_tiktoken(ranks, tmp_path):
    directory = write_kimi(tmp_path / "kimi", ranks)
    ours = Tokenizer.from_directory(directory)
    specials = _kimi_specials(ranks, directory)
    reference = transformers_reference(directory, KIMI, specials)
    encoding = tiktoken.Encoding(
        "kimi",
        pat_str=KIMI.pattern,
        mergeable_ranks=ranks,
        special_tokens={t: len(ranks) + i for i, t in enumerate(specials)},
    )
    assert ours.vocab_size == len(reference) == len(ranks) + 256
    assert ours.bos_token_id == len(ranks) and ours.eos_token_id == len(ranks) + 1
    assert ours.id_to_token(len(ranks) + 5) == f"<|reserved_token_{len(ranks) + 5}|>"
    for text in TEXTS:
        ids = ours.encode(text)
        assert (
            ids == reference(text)["input_ids"] == encoding.encode(text, allowed_special="all")
        ), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )
        assert ours.decode(ids, skip_special_tokens=False) == encoding.decode(ids) == text
    rendered = ours.render_chat(MESSAGES, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(MESSAGES) == reference.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_glm4_tokenizer_model_matches_transformers_and_tiktoken(ranks, tmp_path):
    directory = write_glm4(tmp_path / "glm4", ranks)
    ours = Tokenizer.from_directory(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    specials = [
        config["added_tokens_decoder"][i]["content"]
        for i in sorted(config["added_tokens_decoder"], key=int)
    ]
    reference = transformers_reference(directory, GLM4, specials, prefix=GLM4.prefix)
    encoding = tiktoken.Encoding(
        "glm4",
        pat_str=GLM4.pattern,
        mergeable_ranks=ranks,
        special_tokens={t: len(ranks) + i for i, t in enumerate(specials)},
    )
    prefix = [ours.token_to_id("[gMASK]"), ours.token_to_id("<sop>")]
    assert prefix == [len(ranks) + 2, len(ranks) + 4]
    for text in TEXTS + ["<|user|>\nhi<|assistant|>"]:
        ids = ours.encode(text)
        assert (
            ids
            == reference(text)["input_ids"]
            == prefix + encoding.encode(text, allowed_special="all")
        ), text
        assert ours.encode(text, add_special_tokens=False) == ids[2:]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.render_chat(MESSAGES) == reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(MESSAGES) == reference.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False
    )


# ---- resolution: the rank file its class reads, every other tokenizer file refused by name ----


def _model_dir(directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_bytes(config_json())
    save_file({"w": torch.zeros(2, 2)}, str(directory / "model.safetensors"))
    return directory


def _refusal(directory: Path) -> str:
    with pytest.raises(Refusal) as info:
        resolve(str(directory))
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("writer", [write_kimi, write_glm4])
def test_resolve_takes_the_rank_file_its_class_reads(ranks, tmp_path, writer):
    directory = writer(_model_dir(tmp_path / "m"), ranks)
    checkpoint = resolve(str(directory))
    assert checkpoint.tokenizer_path == directory / (
        "tiktoken.model" if writer is write_kimi else "tokenizer.model"
    )


def test_a_hub_repository_fetches_the_class_then_its_rank_file(ranks, tmp_path, monkeypatch):
    files = write_kimi(tmp_path / "files", ranks)
    with serving(monkeypatch, tmp_path / "hub") as hub:
        hub.add(
            "moonshot-tiny/kimi",
            {
                "config.json": config_json(),
                "model.safetensors": safetensors_bytes(),
                "tiktoken.model": (files / "tiktoken.model").read_bytes(),
                "tokenizer_config.json": (files / "tokenizer_config.json").read_bytes(),
            },
        )
        checkpoint = resolve("moonshot-tiny/kimi")
        assert hub.fetched() == [
            "config.json",
            "tokenizer_config.json",
            "tiktoken.model",
            "model.safetensors",
        ]
    assert checkpoint.tokenizer_path.name == "tiktoken.model"
    text = "Hello 中文 it's"
    assert Tokenizer.from_directory(checkpoint.directory).encode(text) == Tokenizer.from_directory(
        files
    ).encode(text)


def test_a_sentencepiece_tokenizer_model_is_refused_by_its_class(tmp_path):
    directory = _model_dir(tmp_path / "m")
    (directory / "tokenizer.model").write_bytes(b"\x0a\x05spm")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer"})
    )
    message = _refusal(directory)
    assert message.startswith(
        f"tokenizer {directory}/tokenizer.model is not supported by this ster_dist build"
    )
    assert "it names LlamaTokenizer" in message and "ChatGLM4Tokenizer" in message


def test_a_rank_file_without_its_class_is_refused(ranks, tmp_path):
    directory = write_kimi(_model_dir(tmp_path / "m"), ranks)
    (directory / "tokenizer_config.json").write_text(json.dumps({}))
    assert "it names no tokenizer_class" in _refusal(directory)
    with pytest.raises(Refusal, match="tiktoken.model is not supported"):
        Tokenizer.from_directory(directory)


# ---- Kimi-K2: deepseek_v3 under its own model_type, with its tiktoken tokenizer ----


def test_kimi_k2_generates_as_transformers_does(ranks, tmp_path):
    import transformers

    directory = write_kimi(tmp_path / "kimi_k2", ranks)
    _, _, kwargs = DEEPSEEK_TINY["deepseek_v3"]
    vocab = len(ranks) + 256
    config = transformers.DeepseekV3Config(
        **{
            **BASE_CONFIG,
            **kwargs,
            "vocab_size": vocab + 1,
            "bos_token_id": len(ranks),
            "eos_token_id": len(ranks) + 1,
            "pad_token_id": len(ranks) + 1,
        }
    )
    torch.manual_seed(0)
    reference = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "e_score_correction_bias" in name:
                param.copy_(torch.randn(param.shape) * 0.1)
    reference.save_pretrained(directory, safe_serialization=True)
    raw = json.loads((directory / "config.json").read_text())
    raw["model_type"] = "kimi_k2"  # as Kimi-K2's config.json states it
    (directory / "config.json").write_text(json.dumps(raw))
    assert resolve(str(directory)).tokenizer_path.name == "tiktoken.model"

    prompt = "What is 中文? it's DON'T"
    tok = transformers_reference(directory, KIMI, _kimi_specials(ranks, directory))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[
            0, len(ids) :
        ].tolist()
    got = cli_generate(
        f"--model={directory}", f"--prompt={prompt}", "--chat-template=on", "--max-new-tokens=10"
    )
    assert got["prompt_tokens"] == len(ids)
    assert got["completion_tokens"] == len(want)
    assert got["text"] == tok.decode(want, skip_special_tokens=True)


def test_a_tokenizer_json_still_wins(ranks, tmp_path):
    directory = write_kimi(_model_dir(tmp_path / "both"), ranks)
    build_tiny_tokenizer(tmp_path / "tiny")
    (directory / "tokenizer.json").write_bytes((tmp_path / "tiny" / "tokenizer.json").read_bytes())
    assert resolve(str(directory)).tokenizer_path.name == "tokenizer.json"
    text = "the quick brown fox"
    assert Tokenizer.from_directory(directory).encode(text) == Tokenizer.from_directory(
        tmp_path / "tiny"
    ).encode(text)


def test_a_tokenizer_class_that_is_no_name_reads_as_none(ranks, tmp_path):
    directory = write_kimi(_model_dir(tmp_path / "m"), ranks)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": ["TikTokenTokenizer"]})
    )
    assert "it names no tokenizer_class" in _refusal(directory)


def test_a_special_id_far_past_the_ranks_is_refused(ranks, tmp_path):
    directory = write_kimi(tmp_path / "kimi", ranks)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"][str(10**9)] = _entry("<|far|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(Refusal, match="at most 65536 special ids follow the ranks"):
        Tokenizer.from_directory(directory)
