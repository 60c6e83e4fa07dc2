"""`ster generate` with any number of --vector/--strength pairs (Ster 0.14): summed where they share
a layer, so one vector named twice at S steers as it does once at 2S, and a direction beside its
negation at equal strengths answers as the unsteered model does; and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ster_dist.cli import main
from ster_dist.steer.artifact import load_artifact
from ster_dist.load.toy import make_toy_model

DOCS = Path(__file__).parents[1] / "data" / "ster_docs"


def _run(capsys, *argv) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("vectors")
    make_toy_model(root / "model", layers=2, hidden=64, seed=0)
    assert (
        main(
            [
                "vector",
                "train",
                "--model",
                str(root / "model"),
                "--pairs",
                str(DOCS / "pairs.json"),
                "--layers",
                "0,1",
                "--output",
                str(root / "calm.json"),
            ]
        )
        == 0
    )
    negated = load_artifact(str(root / "calm.json"))
    for vector in negated.vectors:
        vector.values = -vector.values
    negated.save(root / "storm.json")
    return root


def _generate(capsys, root, *steering) -> list:
    code, out, err = _run(
        capsys,
        "generate",
        "--model",
        root / "model",
        "--prompt",
        "the sea is",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
        "--logprobs",
        "1",
        *steering,
    )
    assert code == 0, err
    return [out["text"], [round(t["logprob"], 4) for t in out["logprobs"]]]


def test_vectors_are_summed_where_they_share_a_layer(trained, capsys):
    calm, storm = trained / "calm.json", trained / "storm.json"
    plain = _generate(capsys, trained)
    twice = _generate(
        capsys, trained, "--vector", calm, "--strength", "3", "--vector", calm, "--strength", "3"
    )
    once = _generate(capsys, trained, "--vector", calm, "--strength", "6")
    assert twice == once and once != plain  # the direction moves this toy's answer at strength 6
    cancelled = _generate(
        capsys, trained, "--vector", calm, "--strength", "6", "--vector", storm, "--strength", "6"
    )
    assert cancelled == plain


@pytest.mark.parametrize(
    "steering, message",
    [
        (
            ("--vector", "A", "--strength", "1", "--vector", "A"),
            "every --vector needs its own --strength",
        ),
        (
            ("--vector", "A", "--strength", "0", "--vector", "A", "--strength", "0"),
            "every --strength is zero",
        ),
    ],
)
def test_refusals(trained, capsys, steering, message):
    steering = [str(trained / "calm.json") if s == "A" else s for s in steering]
    code, _, err = _run(
        capsys, "generate", "--model", trained / "model", "--prompt", "hi", *steering
    )
    assert code == 2 and message in err
