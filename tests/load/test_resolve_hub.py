"""Hub resolution (seeds/000 "Hugging Face Hub") with the real huggingface_hub client.

HF_ENDPOINT points at tests/hub_server.py's in-memory Hub on 127.0.0.1, so every
request is real HTTP and recorded: the tests assert which files were fetched,
that the gate fetched no weight file, and that HF_TOKEN was sent.
"""

from __future__ import annotations

import json

import pytest

from ster_dist.errors import Refusal
from ster_dist.resolve import describe, resolve
from tests.hub_server import config_json, safetensors_bytes, serving, tokenizer_json

REPO = "tiny-org/tiny-llama"
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with serving(monkeypatch, tmp_path) as server:
        yield server


def transformers_files(config: bytes | None = None, **more: bytes) -> dict[str, bytes]:
    return {
        "config.json": config or config_json(),
        "tokenizer.json": tokenizer_json(),
        SHARDS[0]: safetensors_bytes("a"),
        SHARDS[1]: safetensors_bytes("b"),
        "README.md": b"# tiny",
        **more,
    }


def refused(model: str, revision: str | None = None) -> str:
    with pytest.raises(Refusal) as info:
        resolve(model, revision)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_resolves_to_the_commit_sha(hub, tmp_path):
    sha = hub.add(
        REPO,
        transformers_files(
            **{
                "tokenizer_config.json": b"{}",
                "generation_config.json": b'{"eos_token_id": 2}',
                "optimizer.safetensors": b"x",
                "original/consolidated.safetensors": b"x",
            }
        ),
    )
    ckpt = resolve(REPO)
    assert ckpt.source == "hub" and ckpt.model_revision == sha
    assert ckpt.weight_format == "safetensors"
    # Everything lands in one snapshot directory of the cache under HF_HOME.
    cache = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama"
    assert ckpt.directory == cache / "snapshots" / sha
    assert ckpt.config_path == ckpt.directory / "config.json"
    assert ckpt.tokenizer_path.read_bytes() == tokenizer_json()
    assert [p.name for p in ckpt.weight_files] == SHARDS
    assert ckpt.weight_files[1].read_bytes() == safetensors_bytes("b")
    assert ckpt.tokenizer_config_path.exists() and ckpt.generation_config_path.exists()
    assert hub.fetched() == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        *SHARDS,
    ]
    summary = describe(ckpt)
    assert summary["model_revision"] == sha and summary["source"] == "hub"
    assert summary["family"] == "llama" and summary["files"] == SHARDS
    json.dumps(summary)


def test_revision_selects_the_commit(hub):
    main = hub.add(REPO, transformers_files())
    v2 = hub.add(REPO, transformers_files(config_json(hidden_size=16)), branch="v2")
    assert main != v2
    ckpt = resolve(REPO, "v2")
    assert ckpt.model_revision == v2 and ckpt.raw_config["hidden_size"] == 16
    assert hub.requests[0].path == f"/api/models/{REPO}/revision/v2"
    assert resolve(REPO, main).model_revision == main  # a commit SHA is a revision too


@pytest.mark.parametrize(
    "config, expected",
    [
        (config_json("plamo2"), 'model architecture "plamo2" is unsupported'),
        (config_json(quantization_config={"quant_method": "fp8"}), "is a quantized checkpoint"),
    ],
)
def test_gate_runs_before_any_weight_is_fetched(hub, config, expected):
    hub.add(REPO, transformers_files(config))
    assert expected in refused(REPO)
    assert hub.touched() == ["config.json", "tokenizer.json"]
    assert not any(".safetensors" in r.path for r in hub.requests)


def test_both_formats_read_as_transformers(hub):
    hub.add(
        REPO,
        transformers_files(
            **{"params.json": b'{"dim": 8}', "consolidated.safetensors": safetensors_bytes("c")}
        ),
    )
    ckpt = resolve(REPO)
    assert ckpt.weight_format == "safetensors"
    assert [p.name for p in ckpt.weight_files] == SHARDS
    assert "consolidated.safetensors" not in hub.touched()
    assert "params.json" not in hub.touched()


def test_mistral_only_format(hub):
    hub.add(
        REPO,
        {
            "params.json": b'{"dim": 8, "n_layers": 1}',
            "tokenizer.json": tokenizer_json(),
            "consolidated.safetensors": safetensors_bytes("c"),
        },
    )
    ckpt = resolve(REPO)
    assert ckpt.weight_format == "mistral" and ckpt.config_path.name == "params.json"
    assert [p.name for p in ckpt.weight_files] == ["consolidated.safetensors"]


def test_no_safetensors_refused(hub):
    hub.add(
        REPO,
        {
            "config.json": config_json(),
            "tokenizer.json": tokenizer_json(),
            "pytorch_model.bin": b"pickle",
        },
    )
    assert refused(REPO).startswith(f"model {REPO} publishes no safetensors weights")
    assert "pytorch_model.bin" not in hub.touched()


def test_missing_config_refused(hub):
    hub.add(REPO, {"tokenizer.json": tokenizer_json(), "model.safetensors": safetensors_bytes()})
    assert refused(REPO).startswith(f"model config is missing: {REPO}/config.json")
    assert hub.touched() == []


def test_missing_tokenizer_refused(hub):
    sha = hub.add(REPO, {"config.json": config_json(), "model.safetensors": safetensors_bytes()})
    assert refused(REPO).startswith(f"tokenizer is missing: {REPO}@{sha}/tokenizer.json")
    assert hub.touched() == ["config.json"]


def test_other_tokenizer_refused_by_name(hub):
    sha = hub.add(
        REPO,
        {
            "config.json": config_json(),
            "tokenizer.model": b"spm",
            "model.safetensors": safetensors_bytes(),
        },
    )
    assert f"tokenizer {REPO}@{sha}/tokenizer.model is not supported" in refused(REPO)


def test_missing_repo_refused(hub):
    message = refused("nobody/nothing")
    assert message.startswith(
        "failed to read model repository nobody/nothing: repository not found"
    )
    assert hub.requests[0].path == "/api/models/nobody/nothing/revision/main"


def test_missing_revision_refused(hub):
    hub.add(REPO, transformers_files())
    assert refused(REPO, "no-such-branch").startswith(
        f"failed to read model repository {REPO}: revision no-such-branch not found"
    )


def test_unreachable_endpoint_refused(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    assert refused(REPO).startswith(
        f"failed to read model repository {REPO}: cannot reach http://127.0.0.1:9"
    )


def test_failed_weight_download_refused(hub):
    sha = hub.add(REPO, transformers_files())
    hub.unservable.add(SHARDS[1])  # listed in the model info, answered 404
    assert refused(REPO).startswith(
        f"failed to download {SHARDS[1]}: the file is not published at {sha}"
    )


def test_hf_token_is_sent(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    hub.add(REPO, transformers_files())
    resolve(REPO)
    assert hub.requests
    assert all(r.headers.get("authorization") == "Bearer hf_test_token" for r in hub.requests)
