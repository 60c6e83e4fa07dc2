"""The global `--text`: the same answer as `path: value` lines, before the command or among its
flags."""

from __future__ import annotations

import json
from pathlib import Path

from ster_dist.cli import main

ARTIFACT = str(Path(__file__).parents[1] / "data" / "ster_docs" / "steering-artifact.json")


def _out(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_text_lines_carry_every_field_of_the_json_answer(capsys):
    document = json.loads(_out(capsys, "vector", "inspect", ARTIFACT))
    lines = _out(capsys, "--text", "vector", "inspect", ARTIFACT).splitlines()
    assert lines == _out(capsys, "vector", "inspect", ARTIFACT, "--text").splitlines()
    assert lines[:4] == [
        "schema_version: 1",
        "product: ster",
        "model: toy-llama",
        "model_revision: null",
    ]
    assert "metadata: {}" in lines and "layers[0].layer: 2" in lines and "trait_name: calm" in lines
    leaves = 10 + len(
        document["layers"][0]
    )  # ten top-level scalars or empty objects, then one per layer field
    assert len(lines) == leaves
    shown = dict(line.split(": ", 1) for line in lines)
    assert float(shown["layers[0].norm"]) == document["layers"][0]["norm"]
