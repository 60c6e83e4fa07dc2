"""`ster batch` over Ray Data (issue 59): rows of a JSONL file answered by two replicas of the toy
model equal what `ster generate` answers each prompt alone, come back in input order with their
columns, and a rerun into the same output answers only the rows not written yet. Rows are keyed
and validated as rows.py says (checked without Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ster_dist.batch.rows import row_key, row_request
from ster_dist.errors import Refusal
from tests.cli_run import cli_generate, make_toy

ROOT = Path(__file__).resolve().parents[2]


def rows(n: int) -> list[dict]:
    out = []
    for i in range(n):
        row = {"prompt": f"row {i} says", "max_new_tokens": 3 + i % 4, "extra": i}
        if i % 4 == 1:
            row.update(temperature=0.8, seed=i)
        if i % 5 == 2:
            row = {
                "messages": [{"role": "user", "content": f"chat {i}"}],
                "max_new_tokens": 5,
                "extra": i,
            }
        out.append(row)
    return out


def alone(toy: str, row: dict) -> dict:
    prompt = row["prompt"] if "prompt" in row else row["messages"][0]["content"]
    argv = [f"--model={toy}", f"--prompt={prompt}", f"--max-new-tokens={row['max_new_tokens']}"]
    if "seed" in row:
        argv += [f"--temperature={row['temperature']}", f"--seed={row['seed']}"]
    return cli_generate(*argv)


def ster_batch(toy: str, source: Path, output: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ster_dist.cli",
            "batch",
            "--model",
            toy,
            "--input",
            str(source),
            "--output",
            str(output),
            "--replicas",
            "2",
            "--batch-size",
            "4",
            "--enforce-eager",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def written(output: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(output.glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


@pytest.mark.slow  # an embedded Ray cluster and two replicas, twice: about a minute on 2 cores
def test_ster_batch_rows_equal_ster_generate_alone_in_input_order_and_a_rerun_skips_written_rows(
    tmp_path_factory, tmp_path
):
    toy = make_toy(tmp_path_factory)
    everything = rows(16)
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in everything[:10]))
    report = ster_batch(toy, first, tmp_path / "out")
    assert report["rows_written"] == 10 and report["rows_skipped"] == 0
    got = written(tmp_path / "out")
    assert [r["extra"] for r in got] == list(range(10))  # input order, input columns kept
    for row, answer in zip(everything, got):
        reference = alone(toy, row)
        assert answer["answer"] == reference["text"], row
        assert answer["completion_tokens"] == reference["completion_tokens"]
        assert answer["prompt_tokens"] == reference["prompt_tokens"]
        assert answer["finish_reason"] == reference["finish_reason"]
        assert answer["row_key"] == row_key(row)

    every = tmp_path / "every.jsonl"
    every.write_text("".join(json.dumps(r) + "\n" for r in everything))
    again = ster_batch(toy, every, tmp_path / "out")
    assert again["rows_written"] == 6 and again["rows_skipped"] == 10 and again["rows_total"] == 16
    got = written(tmp_path / "out")
    assert sorted(r["extra"] for r in got) == list(range(16))  # each row once
    assert got[10:] == [a for a in got[10:] if a["extra"] >= 10]
    assert alone(toy, everything[13])["text"] == next(a for a in got if a["extra"] == 13)["answer"]


def test_rows_are_keyed_by_id_or_content_and_a_bad_row_is_refused_naming_it():
    assert row_key({"id": 7, "prompt": "x"}) == "7"
    # a pandas batch (13.0, NaN as None) and an Arrow row (13, absent) key alike
    assert row_key({"prompt": "x", "seed": 13.0, "messages": None}) == row_key(
        {"prompt": "x", "seed": 13}
    )
    assert row_key({"prompt": "x"}) != row_key({"prompt": "y"})
    request, messages = row_request(
        {"prompt": "x", "max_new_tokens": 3.0, "top_k": 5}, "m", {"max_new_tokens": 9}
    )
    assert (request.max_new_tokens, request.top_k, messages) == (3, 5, None)
    with pytest.raises(Refusal, match="row 'r1': give a 'prompt' .* not both"):
        row_request(
            {"id": "r1", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "m", {}
        )
    with pytest.raises(Refusal, match="row 'r2': .*'seed'"):
        # sampling states its seed
        row_request({"id": "r2", "prompt": "x", "temperature": 0.7}, "m", {})
    with pytest.raises(Refusal, match="row 'r3': 'messages' must be a list"):
        row_request({"id": "r3", "messages": "hello"}, "m", {})
