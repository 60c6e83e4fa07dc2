"""Cancelling jobs (issue 59): a running generate job stops at the engine's next step with its KV
blocks freed, writes no output and is journaled `cancelled`, while the engine goes on answering
other jobs; a queued job never runs; a cancelled merge leaves only its resumable work directory;
Ctrl-C and SIGTERM on `ster submit --local` cancel its jobs instead of waiting them out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ster_dist.jobqueue import events
from ster_dist.jobqueue.journal import read
from ster_dist.jobqueue.queue import JobQueue
from ster_dist.running import Cancelled, JobContext, job_scope
from tests.cli_run import cli_generate, make_toy

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, TOKENS = 32, 480  # the toy model has 512 positions


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def long_job(toy: str, directory: Path, job_id: str = "long") -> dict:
    prompts = directory / f"{job_id}-prompts.json"
    prompts.write_text(json.dumps({"prompts": [f"a long answer {i}" for i in range(PROMPTS)]}))
    return {
        "kind": "generate",
        "model": toy,
        "prompts": str(prompts),
        "output": str(directory / f"{job_id}.json"),
        "max_new_tokens": TOKENS,
        "ignore_eos": True,
        "chat_template": "off",
        "id": job_id,
    }


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def engine_of(queue: JobQueue):
    (pooled,) = queue.pool.groups.values()
    return pooled.session._engine


def test_a_running_generate_job_stops_at_the_next_step_frees_its_blocks_and_writes_nothing(
    toy, tmp_path
):
    state = tmp_path / "state"
    spec = long_job(toy, tmp_path)
    with JobQueue(state) as queue:
        queue.submit(spec)
        wait_for(
            lambda: (
                queue.jobs["long"].result is not None
                or queue.jobs["long"].state == "running"
                and queue.pool.groups
                and engine_of(queue) is not None
                and engine_of(queue).stats()["generated_tokens"] > 20
            )
        )
        engine = engine_of(queue)
        asked = time.monotonic()
        assert queue.cancel("long") == {"id": "long", "state": "running"}
        record = queue.wait("long", 30)
        stopped_in = time.monotonic() - asked
        stats = engine.stats()
        # the engine goes on: a job after the cancelled one is answered as it is alone
        after = queue.wait(
            queue.submit(
                {"kind": "generate", "model": toy, "prompt": "after", "max_new_tokens": 4}
            ),
            60,
        )
    assert record["status"] == "cancelled" and record["exit_code"] == 130
    assert "cancelled on request" in record["error"] and record["result"] is None
    assert stopped_in < 10
    assert stats["aborted"] >= 1 and stats["running"] == 0
    assert stats["kv_blocks"]["used"] == 0  # every block of its requests is back in the pool
    assert stats["generated_tokens"] < PROMPTS * TOKENS / 2  # stopped early, not run out
    # no output, no partial
    assert list(tmp_path.glob("long.json*")) == [] and list(tmp_path.glob(".long.json*")) == []
    # journaled: a restart does not rerun it
    assert read(state).entries["long"].result["status"] == "cancelled"
    assert after["status"] == "done"
    assert after["result"] == cli_generate(f"--model={toy}", "--prompt=after", "--max-new-tokens=4")
    with JobQueue(state) as again:
        assert again.poll("long")["state"] == "cancelled" and again.stats()["queued"] == 0


def test_a_queued_job_cancelled_never_runs_and_a_finished_one_stays_done(toy, tmp_path):
    queue = JobQueue(tmp_path / "state")  # not started: both jobs wait
    queue.submit(
        {"kind": "generate", "model": toy, "prompt": "kept", "max_new_tokens": 2, "id": "kept"}
    )
    queue.submit(
        {
            "kind": "generate",
            "model": toy,
            "prompt": "dropped",
            "max_new_tokens": 2,
            "id": "dropped",
        }
    )
    assert queue.cancel("dropped")["state"] == "cancelled"
    with queue.start():
        assert queue.wait("kept", 60)["status"] == "done"
        assert queue.cancel("kept") == {"id": "kept", "state": "done"}
        record = queue.wait("dropped", 1)
    assert (
        record["status"] == "cancelled"
        and record["attempts"] == 0
        and "before it ran" in record["error"]
    )
    assert not queue.jobs["dropped"].events or all(
        "running" not in e["message"] for e in queue.jobs["dropped"].events
    )


def test_a_cancelled_merge_leaves_only_its_work_directory_and_a_rerun_completes_it(tmp_path):
    from ster_dist.adapters.merge import work_dir
    from ster_dist.ops.merge import merge
    from ster_dist.schema.merge import MergeRequest
    from tests.steer.test_merge import ALL7, peft_adapter, read_dir
    from tests.tiny_models import make_tiny

    make_tiny("llama", tmp_path / "base")
    peft_adapter(tmp_path / "base", tmp_path / "adapter", ALL7, r=4, lora_alpha=8)
    out = tmp_path / "out"
    request = MergeRequest(
        model=str(tmp_path / "base"),
        adapter=str(tmp_path / "adapter"),
        output=str(out),
        max_shard_size="60KB",
    )
    context = JobContext("merge-1")

    # cancel as the first shard is written, as `ster queue cancel` would
    def sink(event: dict) -> None:
        if event.get("message", "").startswith("wrote "):
            context.cancel("cancelled on request")

    stop = events.capture(sink)
    try:
        with job_scope(context), pytest.raises(Cancelled, match="job merge-1 was cancelled"):
            merge(request)
    finally:
        stop()
    assert not out.exists()  # no output that looks complete
    assert work_dir(out).is_dir() and any(work_dir(out).glob("*.safetensors"))
    report = merge(request)  # resumes from the work directory
    assert report["resumed_shards"] >= 1
    merge(
        MergeRequest(
            model=request.model,
            adapter=request.adapter,
            output=str(tmp_path / "alone"),
            max_shard_size="60KB",
        )
    )
    assert read_dir(out).keys() == read_dir(tmp_path / "alone").keys()
    assert all(read_dir(out)[k].equal(v) for k, v in read_dir(tmp_path / "alone").items())


@pytest.mark.slow  # a whole `ster submit --local` process each: about 30 s on 2 cores
@pytest.mark.parametrize(
    "signal_number", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"]
)
def test_ctrl_c_or_sigterm_on_submit_local_cancels_its_job(toy, tmp_path, signal_number):
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(long_job(toy, tmp_path)))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ster_dist.cli",
            "submit",
            str(spec_file),
            "--local",
            "--state",
            str(tmp_path / "state"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = []
        while not any("generating for" in line for line in lines):  # the job is in the engine
            line = proc.stderr.readline()
            assert line, "".join(lines)[-2000:]
            lines.append(line)
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal_number)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - sent < 30
    record = json.loads(out)
    assert record["status"] == "cancelled" and signal.Signals(signal_number).name in record["error"]
    assert proc.returncode == 130
    assert list(tmp_path.glob("long.json*")) == []
    assert read(tmp_path / "state").entries["long"].result["status"] == "cancelled"
