"""Every command the README says prints progress does: the quick ones too (families, toy-model,
inspect-model, gguf-import, inspect), each at least one JSON progress event on stderr beside its
result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ster_dist.cli import main
from tests.gguf_fixtures import write_llama


def events(capsys, *argv) -> list[dict]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    json.loads(out)  # the result, on stdout
    lines = [json.loads(line) for line in err.splitlines()]  # every stderr line is a JSON event
    return [e for e in lines if e["event"] == "progress"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    from ster_dist.steer.artifact import Direction, SteeringArtifact

    path = tmp_path_factory.mktemp("steer") / "calm.json"
    made = SteeringArtifact(
        model="toy",
        model_revision=None,
        trait_name="calm",
        method="caa",
        hidden_size=8,
        vectors=[Direction(0, torch.ones(8), 1.0, 0.0)],
    )
    path.write_text(json.dumps(made.to_json()))
    return path


def test_families_print_progress(capsys):
    assert "families from the registry" in events(capsys, "families")[0]["message"]


def test_toy_model_and_inspect_model_print_progress(tmp_path, capsys):
    toy = tmp_path / "toy"
    assert events(capsys, "toy-model", str(toy))[0]["message"].startswith(
        "writing a toy llama model of 2 layer(s)"
    )
    assert events(capsys, "inspect-model", "--model", str(toy))[0]["message"].startswith(
        f"resolving {toy}"
    )


def test_gguf_import_prints_progress(tmp_path, capsys):
    write_llama(tmp_path / "m.gguf")
    said = events(capsys, "gguf-import", str(tmp_path / "m.gguf"), str(tmp_path / "imported"))
    assert said[0]["message"].startswith(f"importing {tmp_path / 'm.gguf'} (")


def test_inspect_prints_progress(capsys, artifact):
    assert (
        events(capsys, "inspect", str(artifact))[0]["message"]
        == f"reading the steering artifact {artifact}"
    )
