"""`ster submit JOB --local` with a job at --tp 2, as a newcomer runs it: the job's ranks run on an
embedded Ray cluster that the command starts on its main thread and stops when it ends, so the
command prints the result record on stdout and exits 0 (it used to hang a minute on exit and die
with "Failed to connect to GCS", every result lost)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cli_run import cli_generate, make_toy

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def test_submit_local_at_tp2_returns_its_results_and_exits_0(toy, tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text(
        json.dumps(
            {
                "kind": "generate",
                "model": toy,
                "prompt": "hello there",
                "max_new_tokens": 4,
                "tp": 2,
                "id": "tp2-local",
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ster_dist.cli",
            "submit",
            str(spec),
            "--local",
            "--state",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout)
    assert (
        record["id"] == "tp2-local" and record["status"] == "done" and record["result"]["tp"] == 2
    )
    alone = cli_generate("--model", toy, "--prompt", "hello there", "--max-new-tokens", "4")
    assert record["result"]["text"] == alone["text"]  # two ranks answer as one does
    for line in done.stderr.splitlines():
        assert isinstance(json.loads(line), dict), line
