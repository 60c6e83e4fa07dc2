"""Ster's workspace (`ster workspace import-pairs | show | select | remove`, `ster onboarding
--import-pairs`) under $XDG_DATA_HOME/ster, and `vector train` reading the active set without
--pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ster_dist.cli import main
from ster_dist.load.toy import make_toy_model

DOCS = Path(__file__).parents[1] / "data" / "ster_docs"


@pytest.fixture(autouse=True)
def data_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "data"


def _run(capsys, *argv) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


def test_import_show_select_remove(tmp_path, capsys, data_home):
    code, shown, err = _run(capsys, "workspace", "import-pairs", DOCS / "pairs.json")
    assert code == 0, err
    assert (
        shown["import"] == "imported"
        and shown["active"] == "pairs"
        and shown["sets"][0]["pair_count"] == 8
    )
    copy = data_home / "ster" / "pairs" / "pairs.json"
    assert copy.read_bytes() == (DOCS / "pairs.json").read_bytes()  # the canonical copy
    assert (
        _run(capsys, "workspace", "import-pairs", DOCS / "pairs.json")[1]["import"] == "unchanged"
    )
    other = tmp_path / "elsewhere" / "pairs.json"  # the same name, other content: the first is kept
    other.parent.mkdir()
    other.write_text(
        json.dumps({"trait_name": "loud", "pairs": [{"positive": "a", "negative": "b"}]})
    )
    code, shown, _ = _run(capsys, "workspace", "import-pairs", other)
    assert (
        code == 1
        and shown["import"] == "conflicting"
        and copy.read_bytes() == (DOCS / "pairs.json").read_bytes()
    )
    storm = tmp_path / "storm.json"
    storm.write_text(other.read_text())
    code, shown, _ = _run(capsys, "onboarding", "--import-pairs", storm)
    assert (
        code == 0
        and shown["active"] == "storm"
        and [s["id"] for s in shown["sets"]] == ["pairs", "storm"]
    )
    assert _run(capsys, "workspace", "select", "pairs")[1]["active"] == "pairs"
    shown = _run(capsys, "workspace", "remove", "pairs")[1]
    assert shown["active"] is None and [s["id"] for s in shown["sets"]] == ["storm"]
    code, _, err = _run(capsys, "workspace", "select", "pairs")
    assert code == 2 and "no pair set 'pairs' in the workspace" in err


def test_an_invalid_set_is_refused_before_anything_is_written(tmp_path, capsys, data_home):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"trait_name": "x", "pairs": [{"positive": "a", "negative": " "}]}))
    code, _, err = _run(capsys, "workspace", "import-pairs", bad)
    assert code == 2 and "empty positive or negative prompt" in err and not data_home.exists()


def test_vector_train_reads_the_active_set_without_pairs(tmp_path, capsys):
    model = tmp_path / "model"
    make_toy_model(model, layers=2, hidden=64, seed=0)
    code, _, err = _run(
        capsys,
        "vector",
        "train",
        "--model",
        model,
        "--layers",
        "1",
        "--output",
        tmp_path / "a.json",
    )
    assert code == 2 and "no --pairs given and no active pair set" in err
    _run(capsys, "workspace", "import-pairs", DOCS / "pairs.json")
    code, _, err = _run(
        capsys,
        "vector",
        "train",
        "--model",
        model,
        "--layers",
        "1",
        "--output",
        tmp_path / "a.json",
    )
    assert code == 0, err
    _run(
        capsys,
        "vector",
        "train",
        "--model",
        model,
        "--layers",
        "1",
        "--output",
        tmp_path / "b.json",
        "--pairs",
        DOCS / "pairs.json",
    )
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
