"""Local-directory resolution (seeds/000 "Local directory"): each rule and refusal, tiny files."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ster_dist.errors import Refusal
from ster_dist.resolve import describe, resolve
from tests.hub_server import config_json, serving, tokenizer_json


def make_dir(
    root: Path,
    config: bytes | None = None,
    tokenizer: bool = True,
    weights: tuple[str, ...] = ("model.safetensors",),
    other: tuple[str, ...] = (),
    params: dict | None = None,
) -> Path:
    """A checkpoint directory: config.json, tokenizer.json, safetensors, empty other files."""
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "config.json").write_bytes(config)
    if params is not None:
        (root / "params.json").write_text(json.dumps(params))
    if tokenizer:
        (root / "tokenizer.json").write_bytes(tokenizer_json())
    for name in weights:
        save_file({"w": torch.zeros(2, 2)}, str(root / name))
    for name in other:
        (root / name).write_bytes(b"")
    return root


def refusal(model: Path | str, revision: str | None = None) -> str:
    with pytest.raises(Refusal) as info:
        resolve(str(model), revision)
    message = str(info.value)
    assert "\n" not in message
    return message


def names(ckpt) -> list[str]:
    return [p.name for p in ckpt.weight_files]


def test_transformers_directory(tmp_path):
    d = make_dir(tmp_path / "m", config_json())
    ckpt = resolve(str(d))
    assert ckpt.source == "local" and ckpt.weight_format == "safetensors"
    assert ckpt.directory == d and ckpt.config_path == d / "config.json"
    assert ckpt.tokenizer_path == d / "tokenizer.json"
    assert ckpt.weight_files == (d / "model.safetensors",)
    assert ckpt.model_revision is None
    assert ckpt.raw_config["model_type"] == "llama"
    summary = describe(ckpt)
    assert summary == {
        "model": str(d),
        "model_revision": None,
        "source": "local",
        "directory": str(d),
        "weight_format": "safetensors",
        "files": ["model.safetensors"],
        "family": "llama",
    }
    json.dumps(summary)


def test_shards_sorted_and_training_files_excluded(tmp_path):
    d = make_dir(
        tmp_path / "m",
        config_json(),
        weights=(
            "model-00002-of-00002.safetensors",
            "model-00001-of-00002.safetensors",
            "optimizer.safetensors",
            "training_args.safetensors",
            "my_optimizer_state.safetensors",
        ),
        other=("model.safetensors.index.json", "README.md"),
    )
    (d / "sub").mkdir()
    save_file({"w": torch.zeros(1)}, str(d / "sub" / "nested.safetensors"))  # top level only
    assert names(resolve(str(d))) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


@pytest.mark.parametrize("kind", ["broken link", "directory", "fifo"])
def test_a_weight_name_that_is_no_regular_file_is_refused_not_skipped(tmp_path, kind):
    # skipped, a shard whose Hub blob is gone reads as "parameter ... is filled by no checkpoint
    # tensor"
    d = make_dir(tmp_path / "m", config_json())
    shard = d / "model-00002-of-00002.safetensors"
    {
        "broken link": lambda: shard.symlink_to(tmp_path / "blobs" / "gone"),
        "directory": shard.mkdir,
        "fifo": lambda: os.mkfifo(shard),
    }[kind]()
    assert refusal(d) == (
        f"model weight file {shard} is not a regular file (a broken link, a directory or a FIFO); "
        "re-download it, or remove it if it is no weight file"
    )
    # a name no format reads stays unread
    (d / "optimizer.safetensors").symlink_to(tmp_path / "gone")
    shard.unlink() if kind != "directory" else shard.rmdir()
    assert names(resolve(str(d))) == ["model.safetensors"]


def test_a_gguf_whose_link_is_broken_is_named_not_called_no_weights(tmp_path):
    d = make_dir(tmp_path / "m", config_json(), weights=())
    (d / "model.gguf").symlink_to(tmp_path / "gone")
    assert refusal(d).startswith(
        f"model weight file {d / 'model.gguf'} is not a regular file (a broken link"
    )


def test_transformers_format_ignores_consolidated(tmp_path):
    d = make_dir(
        tmp_path / "m",
        config_json(),
        params={"dim": 8},
        weights=("model.safetensors", "consolidated.safetensors"),
    )
    ckpt = resolve(str(d))
    assert ckpt.weight_format == "safetensors" and ckpt.config_path.name == "config.json"
    assert names(ckpt) == ["model.safetensors"]


def test_only_consolidated_beside_config_json_is_refused(tmp_path):
    d = make_dir(tmp_path / "m", config_json(), weights=("consolidated.safetensors",))
    message = refusal(d)
    assert message.startswith("model directory contains no safetensors weights")
    assert "Mistral's format" in message


def test_mistral_format(tmp_path):
    d = make_dir(
        tmp_path / "m",
        None,
        params={"dim": 8, "n_layers": 1, "vocab_size": 4},
        weights=(
            "consolidated-00002.safetensors",
            "consolidated-00001.safetensors",
            "model.safetensors",
        ),
    )
    ckpt = resolve(str(d))
    assert ckpt.weight_format == "mistral" and ckpt.config_path == d / "params.json"
    assert names(ckpt) == ["consolidated-00001.safetensors", "consolidated-00002.safetensors"]
    assert ckpt.raw_config["dim"] == 8
    assert describe(ckpt)["family"] == "mistral"


def test_mistral_format_with_experts_is_deepseek_v3(tmp_path):
    d = make_dir(
        tmp_path / "m",
        None,
        params={"dim": 8, "kv_lora_rank": 4, "moe": {}},
        weights=("consolidated.safetensors",),
    )
    assert describe(resolve(str(d)))["family"] == "deepseek_v3"


def test_mistral_format_quantized_is_refused(tmp_path):
    params = {"dim": 8, "quantization": {"qformat_weight": "fp8_e4m3"}}
    d = make_dir(tmp_path / "m", None, params=params, weights=("consolidated.safetensors",))
    assert "is a quantized checkpoint (quantization_config: fp8_e4m3)" in refusal(d)


def test_one_gguf(tmp_path):
    d = make_dir(tmp_path / "m", config_json(), weights=(), other=("x.gguf", "old.bin"))
    ckpt = resolve(str(d))
    assert ckpt.weight_format == "gguf" and ckpt.weight_files == (d / "x.gguf",)


def test_safetensors_win_over_gguf(tmp_path):
    d = make_dir(tmp_path / "m", config_json(), other=("x.gguf",))
    assert resolve(str(d)).weight_format == "safetensors"


def test_two_ggufs_refused_with_count(tmp_path):
    d = make_dir(tmp_path / "m", config_json(), weights=(), other=("a.gguf", "b.gguf"))
    message = refusal(d)
    assert f"model directory {d} contains 2 .gguf files" in message and "exactly one" in message


@pytest.mark.parametrize("pickled", ["pytorch_model.bin", "model.pt", "model.pth"])
def test_pickled_only_refused(tmp_path, pickled):
    d = make_dir(tmp_path / "m", config_json(), weights=(), other=(pickled,))
    message = refusal(d)
    assert message.startswith("model directory contains no safetensors weights")
    assert pickled in message and "never reads" in message
    assert "convert them to safetensors" in message


def test_no_weights_refused(tmp_path):
    d = make_dir(tmp_path / "m", config_json(), weights=("optimizer.safetensors",))
    assert refusal(d).startswith(f"model directory contains no safetensors weights: {d}")


def test_missing_config(tmp_path):
    d = make_dir(tmp_path / "m", None)
    assert refusal(d).startswith(f"model config is missing: {d / 'config.json'}")


def test_missing_tokenizer(tmp_path):
    d = make_dir(tmp_path / "m", config_json(), tokenizer=False)
    assert refusal(d).startswith(f"tokenizer is missing: {d / 'tokenizer.json'}")


# tokenizer.jsonl is PLaMo's, read
@pytest.mark.parametrize("other", ["tokenizer.model", "tiktoken.model"])
def test_other_tokenizer_files_refused_by_name(tmp_path, other):
    d = make_dir(tmp_path / "m", config_json(), tokenizer=False, other=(other,))
    assert f"tokenizer {d / other} is not supported by this ster_dist build" in refusal(d)


def test_invalid_json_config(tmp_path):
    d = make_dir(tmp_path / "m", b'{"model_type": "llama",')
    assert refusal(d).startswith(f"invalid model config {d / 'config.json'}")


def test_config_not_utf8(tmp_path):
    d = make_dir(tmp_path / "m", b'{"model_type": "\xff"}')
    assert refusal(d).startswith(f"invalid model config {d / 'config.json'}")


def test_unreadable_config(tmp_path, monkeypatch):
    d = make_dir(tmp_path / "m", config_json())
    real_read_text = Path.read_text

    def read_text(self, *args, **kwargs):  # tests run as root: permissions cannot make it fail
        if self.name == "config.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert refusal(d) == f"failed to read {d / 'config.json'}: Permission denied"


def test_unlistable_directory(tmp_path, monkeypatch):
    d = make_dir(tmp_path / "m", config_json())

    def iterdir(self):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert refusal(d) == f"failed to list {d}: Permission denied"


def test_unsupported_model_type_refused_first(tmp_path):
    # PLaMo 2 ships tokenizer.jsonl and no weights here: the architecture is what is refused.
    d = make_dir(
        tmp_path / "m",
        config_json("plamo2"),
        tokenizer=False,
        weights=(),
        other=("tokenizer.jsonl",),
    )
    message = refusal(d)
    assert 'model architecture "plamo2" is unsupported' in message
    assert "llama, mistral, mixtral" in message and "dots3_note" in message


@pytest.mark.parametrize("config", [config_json(None), b'{"hidden_size": 8}'])
def test_missing_or_null_model_type(tmp_path, config):
    d = make_dir(tmp_path / "m", config)
    assert 'model architecture "null" is unsupported' in refusal(d)


def test_quantized_refused(tmp_path):
    d = make_dir(tmp_path / "m", config_json(quantization_config={"quant_method": "fp8"}))
    assert "is a quantized checkpoint (quantization_config: fp8)" in refusal(d)


@pytest.mark.parametrize("revision", [None, "v1.0", "0123456789abcdef0123456789abcdef01234567"])
def test_revision_is_recorded_verbatim(tmp_path, revision):
    d = make_dir(tmp_path / "m", config_json())
    ckpt = resolve(str(d), revision)
    assert ckpt.model_revision == revision
    assert describe(ckpt)["model_revision"] == revision


def test_local_directory_never_touches_the_network(tmp_path, monkeypatch):
    with serving(monkeypatch, tmp_path) as hub:
        d = make_dir(tmp_path / "m", config_json())
        resolve(str(d), "main")
        assert hub.requests == []


def test_missing_path_falls_through_to_the_hub(tmp_path, monkeypatch):
    with serving(monkeypatch, tmp_path) as hub:
        monkeypatch.chdir(tmp_path)  # a relative "owner/name" that does not exist here
        message = refusal("models/not-here")
        assert message.startswith(
            "failed to read model repository models/not-here: repository not found"
        )
        assert [r.path for r in hub.requests] == ["/api/models/models/not-here/revision/main"]


def test_missing_absolute_path_is_refused_as_a_hub_id(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "model"
    with serving(monkeypatch, tmp_path) as hub:
        message = refusal(missing)
        assert hub.requests == []  # not a valid repo id: the client refuses it before any request
    assert message.startswith(f"failed to read model repository {missing}: ")
    assert "neither an existing directory nor a valid Hub repository id" in message


def test_a_misspelled_directory_is_named_before_any_hub_request(tmp_path, monkeypatch):
    (tmp_path / "models" / "smollm2").mkdir(parents=True)
    with serving(monkeypatch, tmp_path) as hub:
        monkeypatch.chdir(tmp_path)
        message = refusal("models/smolm2")
        assert hub.requests == []  # the parent exists here: a typo, not a Hub id
    assert message.startswith("no directory models/smolm2: models/ exists here")
    assert "did you mean models/smollm2?" in message
