"""The scheduler in this process (no Ray): jobs sharing one engine equal running one by one,
priorities, idle release, a refused job inside a batch, the journal across a killed scheduler
process, and the Python API and `ster submit --local` on top."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from ster_dist.cli import main
from ster_dist.errors import Refusal
from ster_dist.jobqueue.journal import read, records
from ster_dist.jobqueue.queue import JobQueue
from tests.cli_run import cli_generate, make_toy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def spec(toy, prompt, **fields) -> dict:
    return {"kind": "generate", "model": toy, "prompt": prompt, **fields}


def fifty(toy) -> list[dict]:
    specs = [spec(toy, f"question {i}: what comes after {i}?", max_new_tokens=5) for i in range(40)]
    specs += [spec(toy, f"short {i}", max_new_tokens=3, chat_template="off") for i in range(6)]
    specs += [
        spec(toy, f"sampled {i}", max_new_tokens=4, temperature=0.8, top_p=0.9, seed=i)
        for i in range(4)
    ]
    return specs


def test_fifty_jobs_at_once_share_one_group_and_equal_running_them_one_by_one(toy, tmp_path):
    specs = fifty(toy)
    scheduler = JobQueue(tmp_path / "batched")
    ids: list[str | None] = [None] * len(specs)
    barrier = threading.Barrier(len(specs))

    def submit(i: int) -> None:
        barrier.wait()
        ids[i] = scheduler.submit(specs[i])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(specs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with scheduler.start():
        batched = [scheduler.wait(i, 120) for i in ids]
        stats = scheduler.stats()
    assert all(r["status"] == "done" for r in batched)
    assert stats["group_starts"] == 1
    # the generate jobs on the group ran side by side on its one token engine, sampled ones too
    # (each
    # draws from its own seeded generator, so its tokens do not depend on its batch-mates)
    assert stats["lanes_peak"] > 1

    with JobQueue(tmp_path / "one-by-one", max_lanes=1) as alone:
        one_by_one = [alone.wait(alone.submit(s), 120) for s in specs]
        assert alone.stats()["lanes_peak"] == 1 and alone.stats()["group_starts"] == 1
    assert [r["result"] for r in batched] == [r["result"] for r in one_by_one]

    # and the one-by-one runs are what plain `ster generate` prints, load and all
    for i in (0, 39, 40, 46, 49):
        argv = [f"--{k.replace('_', '-')}={v}" for k, v in specs[i].items() if k != "kind"]
        assert cli_generate(*argv) == batched[i]["result"], i


def test_a_generate_job_arriving_mid_generation_joins_the_running_batch(toy, tmp_path):
    with JobQueue(tmp_path / "state") as scheduler:
        long = scheduler.submit(
            spec(toy, "a long answer", max_new_tokens=400, ignore_eos=True, chat_template="off")
        )
        deadline = time.monotonic() + 60
        while scheduler.poll(long)["events"] == [] or not any(
            "generating" in e.get("message", "") for e in scheduler.poll(long)["events"]
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        short = scheduler.wait(
            scheduler.submit(spec(toy, "short", max_new_tokens=2, chat_template="off")), 60
        )
        assert scheduler.poll(long)["result"] is None  # the short job did not wait for the long one
        assert short["status"] == "done"
        done = scheduler.wait(long, 120)
    assert done["status"] == "done" and done["result"]["completion_tokens"] == 400
    alone = cli_generate(
        f"--model={toy}", "--prompt=short", "--max-new-tokens=2", "--chat-template=off"
    )
    assert short["result"] == alone


def test_higher_priority_runs_first_and_results_come_back_in_submission_order(toy, tmp_path):
    scheduler = JobQueue(tmp_path / "state")
    low = scheduler.submit(spec(toy, "low", max_new_tokens=2, id="low"))
    high = scheduler.submit(spec(toy, "high", max_new_tokens=3, priority=5, id="high"))
    mid = scheduler.submit(spec(toy, "mid", max_new_tokens=4, priority=1, id="mid"))
    with scheduler.start():
        for job_id in (low, high, mid):
            scheduler.wait(job_id, 60)
    order = [r for r in _raw_ops(tmp_path / "state") if r["op"] == "running"]
    assert [r["id"] for r in order] == ["high", "mid", "low"]


def _raw_ops(state: Path) -> list[dict]:
    return [json.loads(json.dumps(r)) for r in records((state / "journal.msgpack").read_bytes())]


def test_an_idle_group_is_released_and_a_later_job_starts_it_again(toy, tmp_path):
    with JobQueue(None, idle_s=0.3) as scheduler:
        scheduler.wait(scheduler.submit(spec(toy, "one", max_new_tokens=2)), 60)
        deadline = time.monotonic() + 10
        while scheduler.stats()["groups"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = scheduler.stats()
        assert stats["groups"] == [] and stats["group_releases"] == 1
        scheduler.wait(scheduler.submit(spec(toy, "two", max_new_tokens=2)), 60)
        assert scheduler.stats()["group_starts"] == 2


def test_a_refused_job_in_a_batch_fails_alone_and_the_others_finish(toy, tmp_path):
    good = [spec(toy, f"fine {i}", max_new_tokens=3, chat_template="off") for i in range(3)]
    # encodes to no tokens: refused at generate
    bad = spec(toy, "", max_new_tokens=3, chat_template="off")
    scheduler = JobQueue(tmp_path / "state")
    ids = scheduler.submit_many([good[0], bad, good[1], good[2]])
    with scheduler.start():
        records = [scheduler.wait(i, 60) for i in ids]
    assert [r["status"] for r in records] == ["done", "failed", "done", "done"]
    assert "encodes to no tokens" in records[1]["error"] and records[1]["exit_code"] == 2
    assert all(r["result"]["completion_tokens"] == 3 for r in records if r["status"] == "done")


def test_a_missing_model_fails_its_job_without_a_retry_and_the_queue_goes_on(toy, tmp_path):
    with JobQueue(tmp_path / "state") as scheduler:
        missing = scheduler.submit(spec(str(tmp_path / "nowhere"), "x", max_new_tokens=2))
        fine = scheduler.submit(spec(toy, "x", max_new_tokens=2))
        first, second = scheduler.wait(missing, 60), scheduler.wait(fine, 60)
    assert first["status"] == "failed" and first["attempts"] == 1 and "nowhere" in first["error"]
    assert second["status"] == "done"


def test_the_same_job_sent_twice_runs_once_and_a_reused_id_is_refused(toy, tmp_path):
    job = spec(toy, "once", max_new_tokens=2, id="only-once")
    with JobQueue(tmp_path / "state") as scheduler:
        assert scheduler.submit(job) == scheduler.submit(dict(job)) == "only-once"
        with pytest.raises(Refusal, match="already taken"):
            scheduler.submit({**job, "prompt": "another"})
        scheduler.wait("only-once", 60)
        assert scheduler.stats()["jobs"] == {"done": 1}
    # a scheduler restarted on the journal still knows it: resending is not a second run
    with JobQueue(tmp_path / "state") as again:
        assert (
            again.submit(job) == "only-once"
            and again.poll("only-once")["result"]["status"] == "done"
        )
        assert again.stats()["group_starts"] == 0


KILLED_SCHEDULER = """
import sys, time
from ster_dist.jobqueue.queue import JobQueue
state, model = sys.argv[1], sys.argv[2]
scheduler = JobQueue(state, max_lanes=1).start()  # one job at a time: the kill lands between them
scheduler.submit_many([{"kind": "generate", "model": model, "prompt": f"job {i}", "max_new_tokens": 24 + i,
                        "chat_template": "off", "id": f"job-{i}"} for i in range(6)])
time.sleep(600)
"""


def test_a_killed_scheduler_process_restarted_finishes_every_accepted_job_once(toy, tmp_path):
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SCHEDULER, str(state), toy],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            entries = read(state).entries
            if sum(e.result is not None for e in entries.values()) >= 2:
                break
            time.sleep(0.02)
    finally:
        # also when the wait above raised: never leave the scheduler running
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    before = read(state).entries
    finished_before = {k for k, e in before.items() if e.result is not None}
    assert len(before) == 6 and 2 <= len(finished_before) < 6

    with JobQueue(state) as restarted:
        records = {f"job-{i}": restarted.wait(f"job-{i}", 120) for i in range(6)}
        reruns = [k for k in finished_before if restarted.jobs[k].events]
    assert all(r["status"] == "done" for r in records.values())
    assert reruns == []  # a finished job is never run again
    finished = [r["id"] for r in _raw_ops(state) if r["op"] == "finished"]
    assert sorted(finished) == sorted(records)  # each accepted job finished exactly once
    for i in (0, 5):
        expected = cli_generate(
            f"--model={toy}",
            f"--prompt=job {i}",
            f"--max-new-tokens={24 + i}",
            "--chat-template=off",
        )
        assert records[f"job-{i}"]["result"] == expected


def test_a_torn_last_record_is_cut_off_on_restart(toy, tmp_path):
    state = tmp_path / "state"
    with JobQueue(state) as scheduler:
        scheduler.wait(scheduler.submit(spec(toy, "kept", max_new_tokens=2, id="kept")), 60)
    record = msgpack.packb({"op": "accepted", "id": "torn", "spec": spec(toy, "torn"), "seq": 9})
    with open(state / "journal.msgpack", "ab") as handle:
        handle.write(record[: len(record) // 2])
    with JobQueue(state) as again:
        assert set(again.jobs) == {"kept"} and again.poll("kept")["result"]["status"] == "done"


def test_one_state_directory_has_one_scheduler(tmp_path):
    first = JobQueue(tmp_path / "state")
    try:
        with pytest.raises(Refusal, match="another job queue holds"):
            JobQueue(tmp_path / "state")
    finally:
        first.close()


def test_the_python_api_runs_every_call_through_the_scheduler(toy):
    from ster_dist.api import Engine
    from ster_dist.schema import GenerateRequest

    events = []
    with Engine(toy, on_event=events.append) as engine:
        one = engine.generate("hello there", max_new_tokens=4)
        many = engine.generate(["hello there", "good bye", "and again"], max_new_tokens=4)
        assert many[0] == one
        # typed
        assert engine.run(GenerateRequest(model=toy, prompt="hello there", max_new_tokens=4)) == one
        assert engine.stats()["group_starts"] == 1 and engine.stats()["jobs"] == {"done": 5}
        with pytest.raises(Refusal, match="unknown job kind 'steer-bogus'"):
            engine.steer("bogus")
        with pytest.raises(Refusal, match="job generate-1 failed: .*encodes to no tokens"):
            engine.generate("", max_new_tokens=2, chat_template="off", id="generate-1")
    assert any(e.get("message", "").startswith("generating for 1 prompt") for e in events)
    assert one == cli_generate(f"--model={toy}", "--prompt=hello there", "--max-new-tokens=4")


def test_ster_submit_local_and_jobs_run_local(toy, tmp_path, capsys):
    path = tmp_path / "jobs.yaml"
    path.write_text(
        f"jobs:\n  - {{kind: generate, model: {toy}, prompt: hi, max_new_tokens: 3}}\n"
        f"  - {{kind: generate, model: {toy}, prompt: ho, max_new_tokens: 3}}\n"
    )
    assert main(["submit", str(path), "--local", "--state", str(tmp_path / "state")]) == 0
    out, err = capsys.readouterr()
    jobs = json.loads(out)["jobs"]
    assert [j["result"]["prompt"] for j in jobs] == ["hi", "ho"] and all(
        j["batch"] == 1 for j in jobs
    )
    assert all(json.loads(line)["event"] for line in err.strip().splitlines())

    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"kind": "generate", "model": toy, "prompt": "x", "max_new_tokens": -1})
    )
    proc = subprocess.run(
        [sys.executable, "jobs/run.py", "--local", "--state", str(tmp_path / "s2"), str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "'max_new_tokens'" in proc.stderr
    assert not (tmp_path / "s2").exists()


def test_a_command_line_run_through_the_scheduler_prints_what_the_command_prints(toy, capsys):
    from ster_dist.cli import parse
    from ster_dist.jobqueue.in_process import run_cli

    argv = [
        "generate",
        "--model",
        toy,
        "--prompt",
        "through the front door",
        "--max-new-tokens",
        "4",
    ]
    assert run_cli(parse(argv)) == (cli_generate(*argv[1:]), 0)
    events = [json.loads(line) for line in capsys.readouterr().err.strip().splitlines()]
    assert any(e["message"].startswith("generating for 1 prompt") for e in events)
    with pytest.raises(Refusal, match="nowhere"):
        run_cli(parse(["generate", "--model", "/nowhere/at/all", "--prompt", "x"]))


def test_a_command_line_in_a_process_with_a_scheduler_is_one_of_its_jobs(toy, capsys):
    """`ster generate` (cli.main) submits to the scheduler already running in its process: the
    job reuses the group that scheduler has warm, and a refusal names the flag, not a spec field."""
    from ster_dist.api import Engine

    with Engine(toy) as engine:
        first = engine.generate("warm", max_new_tokens=3)
        capsys.readouterr()
        assert main(["generate", "--model", toy, "--prompt", "warm", "--max-new-tokens", "3"]) == 0
        out, err = capsys.readouterr()
        stats = engine.stats()
        assert json.loads(out) == first
        assert stats["group_starts"] == 1 and stats["jobs"] == {"done": 2}
        # nothing loaded again
        assert "starting a worker group" not in err and "resolving" not in err
        assert main(["generate", "--model", toy, "--prompt", "x", "--max-new-tokens", "-1"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "--max-new-tokens must be zero or more, got an integer -1"
        assert engine.stats()["jobs"] == {"done": 2}  # refused on arrival: never a job
