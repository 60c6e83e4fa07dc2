"""`ster pairs add | remove | edit | merge` (Ster's pair-set authoring, no model): the file Ster
writes (pretty, trailing newline: the docs' own examples/pairs.json, byte for byte), Ster's
refusals, and `ster request pairs/merge` with Ster's body fields."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from ster_dist.cli import main
from ster_dist.steer.pair_files import save_pairs
from ster_dist.steer.pairs import load_pairs

DOCS = Path(__file__).parents[1] / "data" / "ster_docs"


def _run(capsys, *argv) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def test_a_set_is_written_as_ster_writes_the_docs_example(tmp_path):
    out = tmp_path / "pairs.json"
    save_pairs(str(out), load_pairs(str(DOCS / "pairs.json")))
    assert out.read_bytes() == (DOCS / "pairs.json").read_bytes()


def test_add_remove_edit_and_their_refusals(tmp_path, capsys):
    path = tmp_path / "new" / "pairs.json"  # add creates the file and its directory
    code, answer, err = _run(
        capsys,
        "pairs",
        "add",
        "--pairs",
        path,
        "--trait",
        "calm",
        "--positive",
        "still water",
        "--negative",
        "a storm",
    )
    assert code == 0, err
    assert answer == {"pairs": str(path), "trait_name": "calm", "pair_count": 1}
    _run(
        capsys,
        "pairs",
        "add",
        "--pairs",
        path,
        "--positive",
        "a soft breeze",
        "--negative",
        "a gale",
    )
    code, answer, _ = _run(
        capsys, "pairs", "edit", "--pairs", path, "--index", "1", "--negative", "thunder"
    )
    assert load_pairs(str(path)).pairs == (("still water", "a storm"), ("a soft breeze", "thunder"))
    code, _, err = _run(capsys, "pairs", "edit", "--pairs", path, "--index", "1")
    assert (
        code == 2 and "pairs edit changes nothing without --positive, --negative or --trait" in err
    )
    code, _, err = _run(capsys, "pairs", "remove", "--pairs", path, "--index", "2")
    assert code == 2 and "pair index 2 is outside the set's 0..1 range" in err
    assert _run(capsys, "pairs", "remove", "--pairs", path, "--index", "0")[1]["pair_count"] == 1
    before = path.read_bytes()
    code, _, err = _run(capsys, "pairs", "remove", "--pairs", path, "--index", "0")
    assert code == 2 and f"pair set {path} contains no pairs" in err and path.read_bytes() == before


@pytest.mark.parametrize(
    "sources, trait, message",
    [
        (1, "calm", "pairs merge needs at least two pair sets and got 1"),
        (2, " ", "pairs merge needs the trait name the merged set is fitted for"),
    ],
)
def test_merge_refusals(tmp_path, capsys, sources, trait, message):
    flags = [x for _ in range(sources) for x in ("--pairs", DOCS / "pairs.json")]
    code, _, err = _run(
        capsys, "pairs", "merge", *flags, "--trait", trait, "--output", tmp_path / "m.json"
    )
    assert code == 2 and message in err and not (tmp_path / "m.json").exists()


def test_merge_through_a_request_with_sters_body(tmp_path, capsys, monkeypatch):
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps({"trait_name": "loud", "pairs": [{"positive": "a", "negative": "b"}]})
    )
    body = {
        "sources": [str(DOCS / "pairs.json"), str(other)],
        "traitName": "sea",
        "output": str(tmp_path / "m.json"),
    }
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(body)))
    capsys.readouterr()
    assert main(["request", "pairs/merge"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [s["pair_count"] for s in result["json"]["sources"]] == [8, 1]
    merged = load_pairs(str(tmp_path / "m.json"))
    assert merged.trait_name == "sea" and merged.pairs[-1] == ("a", "b") and len(merged.pairs) == 9
