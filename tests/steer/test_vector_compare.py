"""`ster vector compare`: artifacts compared from their directions alone, the numbers checked
against geometry worked by hand (a direction, its negation, an orthogonal one), and the
refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ster_dist.cli import main
from ster_dist.steer.artifact import Direction, SteeringArtifact


def _save(path, trait: str, values: dict[int, list[float]], model: str = "toy") -> str:
    vectors = [Direction(layer, torch.tensor(v), 1.0, 0.5) for layer, v in values.items()]
    SteeringArtifact(
        model=model,
        model_revision=None,
        trait_name=trait,
        method="caa",
        hidden_size=3,
        vectors=vectors,
    ).save(path)
    return str(path)


def _run(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def test_a_negation_shares_an_axis_and_an_orthogonal_direction_is_unique(tmp_path, capsys):
    a = _save(tmp_path / "a.json", "calm", {1: [1, 0, 0], 2: [0, 0, 1]})
    b = _save(tmp_path / "b.json", "storm", {1: [-1, 0, 0], 2: [0, 0, -1], 3: [1, 1, 1]})
    c = _save(tmp_path / "c.json", "terse", {1: [0, 1, 0], 2: [0, 1, 0]})
    code, out, err = _run(capsys, "vector", "compare", a, b, c, "--clusters", "2")
    assert code == 0, err
    assert out["layers"] == [1, 2]  # the layers all three carry
    pairs = {(r["a"][-6:], r["b"][-6:]): r for r in out["pairs"]}
    assert (
        pairs[("a.json", "b.json")]["similarity"] == -1.0
        and pairs[("a.json", "c.json")]["similarity"] == 0.0
    )
    assert pairs[("a.json", "b.json")]["distance"] == 0.0  # the nearer sign: one axis
    assert pairs[("a.json", "c.json")]["distance"] == pytest.approx(math.sqrt(2))
    assert out["most_different"]["b"] == b and out["most_similar"]["similarity"] == 0.0
    assert [u["uniqueness"] for u in out["uniqueness"]] == pytest.approx([0.0, 0.0, 1.0], abs=1e-12)
    assert out["clusters"] == [0, 0, 1] and out["silhouette"] == pytest.approx(1.0)
    code, out, _ = _run(capsys, "vector", "compare", a, b, c, "--clusters", "3")
    assert out["clusters"] == [0, 1, 2] and out["silhouette"] is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--clusters", "4"), "--clusters 4 must be between 1 and the 3 artifacts compared"),
        (("--clusters", "1", "--layers", "3"), "carries no vector at layer 3"),
    ],
)
def test_refusals(tmp_path, capsys, extra, message):
    paths = [_save(tmp_path / f"{i}.json", "t", {1: [1, float(i), 0]}) for i in range(3)]
    code, _, err = _run(capsys, "vector", "compare", *paths, *extra)
    assert code == 2 and message in err


def test_artifacts_of_two_models_are_refused(tmp_path, capsys):
    a = _save(tmp_path / "a.json", "t", {1: [1, 0, 0]})
    b = _save(tmp_path / "b.json", "t", {1: [0, 1, 0]}, model="other")
    code, _, err = _run(capsys, "vector", "compare", a, b, "--clusters", "1")
    assert code == 2 and "compare artifacts of one model" in err
    code, _, err = _run(capsys, "vector", "compare", a, "--clusters", "1")
    assert code == 2 and "vector compare needs at least two artifacts and got 1" in err


def test_curve_scores_growing_fits_on_one_holdout(tmp_path, capsys):
    """`vector curve` on the docs' eight pairs: a quarter held out (2), fits of 1, 3 and 6 pairs; a
    fit of all 6 scores as optimize's caa candidate at that layer (the same split, the same fit)."""
    from ster_dist.load.toy import make_toy_model

    docs = Path(__file__).parents[1] / "data" / "ster_docs" / "pairs.json"
    model = tmp_path / "model"
    make_toy_model(model, layers=2, hidden=64, seed=0)
    code, out, err = _run(
        capsys,
        "vector",
        "curve",
        "--model",
        model,
        "--pairs",
        docs,
        "--method",
        "caa",
        "--holdout",
        "0.25",
        "--sizes",
        "1,3,6",
        "--layers",
        "1",
    )
    assert code == 0, err
    assert out["holdout"] == {"fraction": 0.25, "fit_pairs": 6, "holdout_pairs": 2}
    assert [(p["size"], p["layer"]) for p in out["points"]] == [(1, 1), (3, 1), (6, 1)]
    best = max(p["holdout_accuracy"] for p in out["points"])
    assert out["enough"] == [
        {
            "layer": 1,
            "size": min(p["size"] for p in out["points"] if p["holdout_accuracy"] == best),
            "holdout_accuracy": best,
        }
    ]
    code, ranked, err = _run(
        capsys,
        "vector",
        "optimize",
        "--model",
        model,
        "--pairs",
        docs,
        "--holdout",
        "0.25",
        "--layers",
        "1",
        "--output",
        tmp_path / "o.json",
    )
    caa = next(r for r in ranked["selection"]["candidates"] if r["method"] == "caa")
    assert (caa["holdout_accuracy"], caa["holdout_margin"]) == (
        out["points"][2]["holdout_accuracy"],
        out["points"][2]["holdout_margin"],
    )
    code, _, err = _run(
        capsys,
        "vector",
        "curve",
        "--model",
        model,
        "--pairs",
        docs,
        "--method",
        "caa",
        "--holdout",
        "0.25",
        "--sizes",
        "7",
    )
    assert (
        code == 2
        and "a size of 7 pairs does not fit in the 6 pairs left to fit on after holding out 2"
        in err
    )
