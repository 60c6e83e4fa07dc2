"""Ster's own command names (`ster train`, `optimize`, `evaluate`, `inspect`) beside ster_dist's
grouped ones (`ster steer ...`): the same request, flags and result, and the names Ster's serve API
routes by."""

from __future__ import annotations

import json

from ster_dist.cli import build_parser, main
from ster_dist.schema import REQUESTS
from ster_dist.serve.ster_api import ENDPOINTS
from tests.cli_run import make_toy

PROMPTS = [
    "I love this, it is wonderful",
    "What a great and happy day",
    "I hate this, it is awful",
    "What a terrible and sad day",
]


def _run(capsys, *argv) -> dict:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    return json.loads(out)


def test_each_ster_name_takes_the_grouped_commands_flags():
    parser = build_parser()
    named = [cls for cls in REQUESTS if cls.ster_name]
    assert sorted(cls.ster_name for cls in named) == ["evaluate", "inspect", "optimize", "train"]
    root = next(a for a in parser._actions if a.dest == "command")
    for cls in named:
        grouped = root.choices[cls.command[0]]._actions[-1].choices[cls.command[-1]]
        alias = root.choices[cls.ster_name]
        assert [a.dest for a in alias._actions] == [a.dest for a in grouped._actions]
        assert alias.get_default("request_class") is grouped.get_default("request_class") is cls
        assert ENDPOINTS[cls.ster_name] is cls  # Ster's serve API routes by the same names


def test_ster_train_and_inspect_equal_the_steer_commands(tmp_path_factory, tmp_path, capsys):
    toy = make_toy(tmp_path_factory)
    pairs = tmp_path / "pairs.json"
    pairs.write_text(
        json.dumps(
            {
                "trait_name": "mood",
                "pairs": [{"positive": a, "negative": b} for a, b in zip(PROMPTS[:2], PROMPTS[2:])],
            }
        )
    )
    results = {}
    for words in (("train",), ("steer", "train")):
        out = tmp_path / f"{'-'.join(words)}.json"
        results[words] = _run(
            capsys, *words, "--model", toy, "--pairs", pairs, "--output", out, "--layers", "1"
        )
        results[words + ("artifact",)] = json.loads(out.read_text())["vectors"]
    assert results[("train", "artifact")] == results[("steer", "train", "artifact")]
    assert _run(capsys, "inspect", tmp_path / "train.json") == _run(
        capsys, "steer", "inspect", tmp_path / "steer-train.json"
    )
