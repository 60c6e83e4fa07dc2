"""Generate jobs side by side on one worker group's one token engine (issue 59): six jobs with
prompts files submitted at once each write what `ster generate --prompts` alone writes, and jobs
recovered after the job queue's process was killed with SIGKILL finish the same way. (Each lane
used to build an engine of its own over the same ranks, every engine numbering its requests from
r0: the ranks' sampler refused the second `r0` and the jobs failed.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ster_dist.jobqueue.journal import read
from ster_dist.jobqueue.queue import JobQueue
from tests.cli_run import cli_generate, make_toy

ROOT = Path(__file__).resolve().parents[2]
JOBS = 6


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def prompts_jobs(toy: str, directory: Path, new_tokens: int = 6) -> list[dict]:
    specs = []
    for job in range(JOBS):
        prompts = directory / f"prompts-{job}.json"
        prompts.write_text(
            json.dumps({"prompts": [f"job {job} asks question {i}" for i in range(4)]})
        )
        specs.append(
            {
                "kind": "generate",
                "model": toy,
                "prompts": str(prompts),
                "output": str(directory / f"out-{job}.json"),
                "max_new_tokens": new_tokens + job,
                "chat_template": "off",
                "id": f"file-{job}",
                **({"temperature": 0.7, "seed": job} if job % 2 else {}),
            }
        )
    return specs


def alone(spec: dict, directory: Path) -> dict:
    """`ster generate --prompts` for the spec, in a session of its own: the output file it
    writes."""
    output = directory / f"alone-{spec['id']}.json"
    argv = [
        f"--{k.replace('_', '-')}={v}" for k, v in spec.items() if k not in ("kind", "id", "output")
    ]
    cli_generate(*argv, f"--output={output}")
    return json.loads(output.read_text())


def test_six_prompts_file_jobs_at_once_share_one_engine_and_each_writes_what_it_writes_alone(
    toy, tmp_path
):
    specs = prompts_jobs(toy, tmp_path)
    started = time.perf_counter()
    with JobQueue(tmp_path / "state") as queue:
        records = [queue.wait(job_id, 120) for job_id in queue.submit_many(specs)]
        stats = queue.stats()
    together = time.perf_counter() - started
    assert [r["status"] for r in records] == ["done"] * JOBS, [r["error"] for r in records]
    assert stats["group_starts"] == 1 and stats["lanes_peak"] > 1  # side by side on one group
    for spec in specs:
        assert json.loads(Path(spec["output"]).read_text()) == alone(spec, tmp_path), spec["id"]
    print(f"{JOBS} prompts-file jobs at once: {together:.1f} s (load included)")


KILLED = """
import json, sys, time
from ster_dist.jobqueue.queue import JobQueue
queue = JobQueue(sys.argv[1]).start()
queue.submit_many(json.loads(sys.argv[2]))
time.sleep(600)
"""


@pytest.mark.slow  # a child job queue killed mid-run, then a restart: about 25 s on 2 cores
def test_jobs_recovered_after_a_sigkill_all_finish_as_they_would_alone(toy, tmp_path):
    specs = prompts_jobs(toy, tmp_path, new_tokens=40)
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(state), json.dumps(specs)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
            e.attempts for e in read(state).entries.values()
        ):
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # also when the wait above raised: never leave it running
        proc.wait(30)
    before = read(state).entries
    assert len(before) == JOBS and any(e.attempts for e in before.values())
    assert not all(e.result is not None for e in before.values())
    with JobQueue(state) as restarted:
        records = [restarted.wait(spec["id"], 180) for spec in specs]
    assert [r["status"] for r in records] == ["done"] * JOBS, [r["error"] for r in records]
    # a greedy and a sampled one: the rest were checked above at other lengths
    for spec in specs[:2]:
        assert json.loads(Path(spec["output"]).read_text()) == alone(spec, tmp_path), spec["id"]
