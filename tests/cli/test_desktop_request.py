"""`ster request <operation>` as Ster's guide/desktop-requests.md specifies it: a camelCase JSON
body on stdin, NDJSON log events and one result event on stdout, statuses 0 (the command's own
document), 1 (started and failed: the last log is `error: ...`) and 2 (refused before anything
ran, no log before it), and a closed stdout ending a training run at its next event."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ster_dist.cli import main
from ster_dist.desktop_request import NOT_IN_STER_DIST, operations
from ster_dist.load.toy import make_toy_model

DOCS = Path(__file__).parents[1] / "data" / "ster_docs"
TABLE = (
    "vector/train",
    "vector/optimize",
    "vector/curve",
    "vector/evaluate",
    "vector/inspect",
    "vector/compare",
    "vector/project",
    "vector/ablate",
    "generate",
    "extract",
    "decide",
    "calibrate",
    "workspace/import-pairs",
    "workspace/show",
    "workspace/select",
    "workspace/remove",
    "pairs/import",
    "pairs/inspect",
    "pairs/merge",
    "pairs/save",
    "pairs/synthesize",
    "tune/sft",
    "tune/dpo",
    "tune/reward",
    "tune/grpo",
    "tune/merge",
    "tune/evaluate",
    "tune/inspect",
)


def request(monkeypatch, capsys, operation: str, body) -> tuple[int, list[dict]]:
    text = body if isinstance(body, str) else json.dumps(body)
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    capsys.readouterr()
    code = main(["request", operation])
    lines = capsys.readouterr().out.splitlines()
    events = [json.loads(line) for line in lines]  # NDJSON only
    assert events[-1]["type"] == "result" and events[-1]["status"] == code
    assert all(e["type"] == "log" and e["stream"] == "stderr" for e in events[:-1])
    return code, events


def cli(capsys, *argv) -> dict:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_every_operation_in_stars_table_is_known():
    known = set(operations()) | set(NOT_IN_STER_DIST)
    assert set(TABLE) <= known and not set(operations()) & set(NOT_IN_STER_DIST)


def test_status_0_answers_the_commands_own_document(monkeypatch, capsys):
    artifact = str(DOCS / "steering-artifact.json")
    code, events = request(monkeypatch, capsys, "vector/inspect", {"artifact": artifact})
    assert code == 0 and events[-1]["json"] == cli(capsys, "vector", "inspect", artifact)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("toy_request") / "model"
    make_toy_model(directory, layers=2, hidden=64, seed=0)
    return directory


def test_a_model_operation_runs_with_camel_case_fields_and_logs_its_progress(
    monkeypatch, capsys, toy, tmp_path
):
    body = {
        "model": str(toy),
        "pairs": str(DOCS / "pairs.json"),
        "output": str(tmp_path / "r.json"),
        "layers": "1",
        "chatTemplate": "off",
        "batchSize": 4,
    }
    code, events = request(monkeypatch, capsys, "vector/train", body)
    assert code == 0, events[-1]
    assert any("reading 8 pairs" in e["chunk"] for e in events[:-1])
    by_cli = cli(
        capsys,
        "vector",
        "train",
        "--model",
        toy,
        "--pairs",
        DOCS / "pairs.json",
        "--output",
        tmp_path / "c.json",
        "--layers",
        "1",
        "--chat-template",
        "off",
        "--batch-size",
        "4",
    )
    assert events[-1]["json"] == {**by_cli, "output": str(tmp_path / "r.json")}
    assert (tmp_path / "r.json").read_bytes() == (tmp_path / "c.json").read_bytes()


def test_status_1_ends_with_the_error_logged(monkeypatch, capsys, tmp_path):
    code, events = request(
        monkeypatch, capsys, "vector/inspect", {"artifact": str(tmp_path / "absent.json")}
    )
    assert code == 1 and events[-2]["chunk"].startswith("error: failed to read steering artifact")
    assert events[-1]["json"]["error"] == events[-2]["chunk"][len("error: ") :].rstrip("\n")


@pytest.mark.parametrize(
    "operation, body, error",
    [
        ("vector/inspct", {"artifact": "a.json"}, "unknown operation: vector/inspct"),
        (
            "tune/sft",
            '{"model": "m",\n "examples": "e.json", "output": "o", "epochs": 1, "seed": 0}',
            "request body is not valid JSON: missing field `learningRate` at line 2 column 61",
        ),
        (
            "generate",
            {"model": "m", "prompt": "hi", "temperature": 0, "seed": 1},
            "request body is not valid JSON: missing field `maxNewTokens` at line 1 column 59",
        ),
        (
            "vector/optimize",
            {"model": "m", "pairs": "p.json", "output": "o.json"},
            "request body is not valid JSON: missing field `holdout`",
        ),
        (
            "generate",
            {
                "model": "m",
                "prompt": "hi",
                "maxNewTokens": 4,
                "temperature": 0,
                "seed": 1,
                "steering": [{"vector": "v.json"}],
            },
            "request body is not valid JSON: missing field `strength`",
        ),
        (
            "vector/inspect",
            '{"artifact": ',
            "request body is not valid JSON: Expecting value at line 1 column 14",
        ),
        (
            "vector/inspect",
            {"artifact": "a.json", "colour": 1},
            "request body is not valid JSON: unknown field `colour`",
        ),
        (
            "extract",
            {
                "model": "m",
                "input": "p.json",
                "output": "o",
                "format": "ster-json",
                "positions": "all",
            },
            "ster-json holds the final token of each prompt only",
        ),
        (
            "vector/curve",
            {"model": "m", "pairs": "p.json", "method": "caa", "sizes": "1"},
            "missing field `holdout`",
        ),
        ("vector/ablate", {}, "operation vector/ablate is Ster's but not ster_dist's yet"),
    ],
)
def test_status_2_is_refused_before_anything_runs(monkeypatch, capsys, operation, body, error):
    code, events = request(monkeypatch, capsys, operation, body)
    assert code == 2 and len(events) == 1 and error in events[0]["json"]["error"]


@pytest.mark.slow  # ~18 s: a process of its own, started and stopped
def test_a_closed_stdout_ends_a_training_run_at_its_next_event(toy, tmp_path):
    """The reader takes the first event and closes; the run stops there, not after its epochs."""
    examples = tmp_path / "examples.json"
    examples.write_text(
        json.dumps(
            {
                "examples": [
                    {"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(4)
                ]
            }
        )
    )
    body = {
        "model": str(toy),
        "examples": str(examples),
        "output": str(tmp_path / "adapter"),
        "learningRate": 1e-3,
        "epochs": 100000,
        "seed": 0,
        "launcher": "spawn",
    }
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "ster_dist.cli", "request", "tune/sft"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    process.stdin.write(json.dumps(body).encode())
    process.stdin.close()
    first = json.loads(process.stdout.readline())
    assert first["type"] == "log"
    process.stdout.close()
    closed = time.monotonic()
    try:
        process.wait(timeout=60)
    finally:
        process.kill()
    assert time.monotonic() - closed < 60 and not (tmp_path / "adapter").exists()


def test_decide_takes_its_request_document_inline(monkeypatch, capsys, toy, tmp_path):
    """The desktop composes decide's request, so the body carries it under `request`; the answer
    is the document `ster decide --request FILE` prints for the same document."""
    document = json.loads(
        (Path(__file__).parents[2] / "jobs/examples/data/request.json").read_text()
    )
    code, events = request(monkeypatch, capsys, "decide", {"model": str(toy), "request": document})
    assert code == 0, events[-1]
    path = tmp_path / "request.json"
    path.write_text(json.dumps(document))
    assert events[-1]["json"] == cli(capsys, "decide", "--model", toy, "--request", path)
