"""The job queue never stalls: a job that hangs is failed at its timeout (its spec's timeout_s, else
the queue's job_timeout), its group dropped and the jobs behind it run on a fresh one; and a pooled
Ray group never holds the CPUs a batch merge's Ray tasks wait for.

A job that truly hangs: its --vector is a named pipe nobody writes (tests/held_vector.py), so the
job blocks reading it, mid-attempt, with its worker group in hand."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ster_dist import protocol
from ster_dist.errors import Refusal
from ster_dist.jobqueue.journal import read, records
from ster_dist.jobqueue.queue import JobQueue
from tests.cli_run import cli_generate, make_toy
from tests.held_vector import HeldVector
from tests.steer.test_steer import PAIRS


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def generate(toy: str, prompt: str, **fields) -> dict:
    return {
        "kind": "generate",
        "model": toy,
        "prompt": prompt,
        "max_new_tokens": 5,
        "chat_template": "off",
        **fields,
    }


def reference(toy: str, prompt: str) -> dict:
    return cli_generate(
        f"--model={toy}", f"--prompt={prompt}", "--max-new-tokens=5", "--chat-template=off"
    )


def messages(queue: JobQueue, job_id: str) -> list[str]:
    return [e.get("message", "") for e in queue.poll(job_id)["events"]]


def unblock(held: HeldVector, fd: int | None = None) -> None:
    """End the abandoned job's wait on its pipe: an empty vector file, refused, and its thread
    ends."""
    fd = held.wait_for_reader(timeout=30) if fd is None else fd
    os.close(fd)


def thread_ends(name: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(t.name == name for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_job_past_its_timeout_fails_and_the_jobs_behind_it_run_on_a_fresh_group(toy, tmp_path):
    held = HeldVector(tmp_path, toy)
    state = tmp_path / "state"
    queue = JobQueue(state, max_lanes=1)  # one lane: a job behind the stuck one truly waits for it
    stuck = queue.submit({**held.job(toy, "stuck"), "id": "stuck", "timeout_s": 4})
    # queued right behind it
    mate = queue.submit(generate(toy, "batched with the stuck one", id="mate"))
    started = time.monotonic()
    with queue.start():
        # stuck, mid-attempt
        fd = held.wait_for_reader(lambda: queue.poll(stuck)["result"], timeout=60)
        behind = queue.submit(generate(toy, "queued behind", id="behind"))
        failed = queue.wait(stuck, 60)
        failed_at = time.monotonic() - started
        results = {job_id: queue.wait(job_id, 120) for job_id in (mate, behind)}
        elapsed = time.monotonic() - started
        stats = queue.stats()
        history = list(queue.pool.history)
        events = {job_id: messages(queue, job_id) for job_id in (stuck, mate, behind)}
    assert failed["status"] == "failed" and failed["attempts"] == 1 and failed["exit_code"] == 1
    assert failed["error"].startswith("job stuck ran past its timeout of 4 s; "), failed["error"]
    assert "worker group was dropped" in failed["error"] and "\n" not in failed["error"]
    assert 4 <= failed_at < 40 and elapsed < 90, (failed_at, elapsed)
    # the jobs behind get their turn, both on a fresh group
    assert all(r["status"] == "done" for r in results.values()), results
    assert results[mate]["result"] == reference(toy, "batched with the stuck one")
    assert results[behind]["result"] == reference(toy, "queued behind")
    assert stats["group_starts"] == 2 and [why for why, _ in history[:2]] == ["start", "timeout"], (
        history
    )
    # the attempt's thread reports as the job: the fresh group's load is told to the job that made
    # it, the one
    # behind the stuck job or its mate (they share the group's one engine, whichever reaches it
    # first)
    assert any(m.startswith("loading") for m in events[behind] + events[mate])
    assert any(m.startswith("job stuck ran past its timeout") for m in events[stuck])

    # journaled as other failures: a restart keeps the failure and runs nothing again
    entry = read(state).entries["stuck"]
    assert entry.result == failed and entry.attempts == 1
    ran = [
        r["id"] for r in records((state / "journal.msgpack").read_bytes()) if r["op"] == "running"
    ]
    assert ran.count("stuck") == 1
    with JobQueue(state) as again:
        assert again.poll(stuck)["result"] == failed and again.stats()["queued"] == 0
        time.sleep(0.5)
        assert again.stats()["group_starts"] == 0

    # the abandoned thread ends once its pipe gives out, and what it held is closed
    unblock(held, fd)
    assert thread_ends("ster-job-stuck")


def test_a_job_sharing_the_dropped_group_runs_again_on_a_fresh_one(toy, tmp_path):
    for name in ("late", "sharer"):
        (tmp_path / name).mkdir()
    late, sharer = HeldVector(tmp_path / "late", toy), HeldVector(tmp_path / "sharer", toy)
    with JobQueue(tmp_path / "state") as queue:
        stuck = queue.submit({**late.job(toy, "stuck"), "id": "late", "timeout_s": 10})
        fd_late = late.wait_for_reader(lambda: queue.poll(stuck)["result"], timeout=60)
        # a generate job in a lane of its own on the same group (its token engine): held too, no
        # timeout
        other = queue.submit({**sharer.job(toy, "sharing its group"), "id": "sharer"})
        fd_sharer = sharer.wait_for_reader(lambda: queue.poll(other)["result"], timeout=60)
        # only its first attempt holds the pipe; a second one reads a plain file
        sharer.path.unlink()
        sharer.path.write_text(sharer.text)
        failed = queue.wait(stuck, 60)
        done = queue.wait(other, 120)
        events = messages(queue, other)
    assert failed["status"] == "failed" and failed["error"].startswith(
        "job late ran past its timeout of 10 s"
    )
    # closing the dropped group under it would have ended it early (or, as here, never): it ran
    # again
    assert done["status"] == "done" and done["attempts"] == 2, done
    assert any(
        m.startswith("the worker group this job ran on was dropped (job(s) late ran past")
        for m in events
    )
    plain = cli_generate(
        f"--model={toy}", "--prompt=sharing its group", "--max-new-tokens=12", "--chat-template=off"
    )
    assert done["result"]["text"] == plain["text"] and done["result"]["steering"]["strength"] == 1.0
    for fd, name in ((fd_late, "late"), (fd_sharer, "sharer")):
        os.close(fd)
        assert thread_ends(f"ster-job-{name}")


def test_the_queue_default_timeout_frees_the_executor_and_a_spec_overrides_it(toy, tmp_path):
    held = HeldVector(tmp_path, toy)
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps(PAIRS))
    started = time.monotonic()
    # steer evaluate runs on the executor itself (not a lane): the case that stalled the whole queue
    with JobQueue(tmp_path / "state", job_timeout=3) as queue:
        stuck = queue.submit(
            {
                "kind": "steer-evaluate",
                "model": toy,
                "pairs": str(pairs),
                "vector": str(held.path),
                "chat_template": "off",
                "id": "stuck-evaluate",
            }
        )
        after = queue.submit(generate(toy, "after the stuck one", timeout_s=120))
        failed = queue.wait(stuck, 60)
        done = queue.wait(after, 120)
    elapsed = time.monotonic() - started
    assert failed["status"] == "failed" and failed["error"].startswith(
        "job stuck-evaluate ran past its timeout of 3 s; "
    ), failed["error"]
    assert done["status"] == "done" and done["result"] == reference(toy, "after the stuck one")
    assert elapsed < 90, elapsed
    unblock(held)
    assert thread_ends("ster-job-stuck-evaluate")


def test_ster_submit_local_fails_a_job_at_its_timeout_s_and_stops_waiting_at_its_own_timeout(
    toy, tmp_path, capsys
):
    from ster_dist.cli import main

    held = HeldVector(tmp_path, toy)
    jobs = tmp_path / "jobs.json"
    jobs.write_text(
        json.dumps(
            {
                "jobs": [
                    {**held.job(toy, "stuck"), "id": "stuck", "timeout_s": 3},
                    generate(toy, "the next one", id="next"),
                ]
            }
        )
    )
    started = time.monotonic()
    assert main(["submit", "--local", str(jobs)]) == 1  # a job failed; the command did not hang
    out, err = capsys.readouterr()
    stuck, after = json.loads(out)["jobs"]
    assert stuck["status"] == "failed" and stuck["error"].startswith(
        "job stuck ran past its timeout of 3 s; "
    )
    assert after["status"] == "done" and after["result"] == reference(toy, "the next one")
    assert "job stuck (generate) failed: job stuck ran past its timeout of 3 s" in err
    assert time.monotonic() - started < 60
    unblock(held)
    assert thread_ends("ster-job-stuck")

    # --timeout only stops waiting: the command ends then, without waiting on for the stuck job
    wait_only = tmp_path / "wait-only.json"
    wait_only.write_text(json.dumps({**held.job(toy, "stuck"), "id": "waited-out"}))
    started = time.monotonic()
    assert main(["submit", "--local", "--timeout", "3", str(wait_only)]) == 2
    _, err = capsys.readouterr()
    assert time.monotonic() - started < 30
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("1 job(s) did not finish within 3.0 s; stopped waiting (--timeout)")
    )
    unblock(held)
    assert thread_ends("ster-job-waited-out")


def test_timeout_s_is_a_spec_field_of_its_own(toy):
    spec = protocol.validate({**generate(toy, "x"), "timeout_s": 2.5, "id": "t"}, check_model=False)
    assert spec.timeout_s == 2.5 and "timeout_s" not in spec.fields
    # journaled and replayed whole
    assert protocol.validate(spec.to_dict(), check_model=False) == spec
    assert protocol.validate(generate(toy, "x"), check_model=False).timeout_s is None
    for bad in (0, -1, "10", True, float("inf"), float("nan")):
        with pytest.raises(
            Refusal, match="job spec field 'timeout_s' must be a number of seconds above 0"
        ):
            protocol.validate({**generate(toy, "x"), "timeout_s": bad}, check_model=False)
    with pytest.raises(Refusal, match="job_timeout"):
        JobQueue(None, job_timeout=0)


# -- a pooled Ray group and a batch merge's Ray tasks
# ------------------------------------------------


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    """An embedded Ray cluster of 2 CPUs (one tp=2 group could reserve them all), two toy models and
    an adapter for the first."""
    import ray

    from ster_dist.load.toy import make_toy_model
    from ster_dist.workers.ray_group import start_ray
    from tests.steer.test_merge import ster_adapter

    root = tmp_path_factory.mktemp("cluster")
    toys = [root / f"toy{i}" for i in range(2)]
    for seed, directory in enumerate(toys):
        make_toy_model(directory, layers=2, hidden=64, seed=seed)
    adapter = root / "calm.safetensors"
    ster_adapter(adapter, toys[0], ["query", "value"], [0, 1])
    started = start_ray(None, num_cpus=2)
    try:
        yield toys, adapter
    finally:
        if started and ray.is_initialized():
            ray.shutdown()


def merge_job(toy: Path, adapter: Path, out: Path) -> dict:
    return {
        "kind": "merge",
        "merges": [
            {"model": str(toy), "adapter": str(adapter), "output": str(out / f"merged-{i}")}
            for i in range(2)
        ],
    }


def timed_wait(queue: JobQueue, job_id: str, timeout: float = 120) -> tuple[dict, float]:
    began = time.monotonic()
    record = queue.wait(job_id, timeout)  # TimeoutError: the stall this guards against
    return record, time.monotonic() - began


def test_a_batch_merge_queued_behind_a_pooled_tp2_group_gets_cpus_at_once(small_cluster, tmp_path):
    toys, adapter = small_cluster
    with JobQueue(None, idle_s=600) as queue:  # the group stays pooled, idle, all along
        generated = queue.wait(queue.submit(generate(str(toys[0]), "one group", tp=2)), 180)
        merged, seconds = timed_wait(queue, queue.submit(merge_job(toys[0], adapter, tmp_path)))
        history = list(queue.pool.history)
    print(f"batch merge beside one pooled tp=2 group: {seconds:.1f} s")
    assert generated["status"] == "done" and merged["status"] == "done", merged
    assert merged["result"]["merged"] == 2 and seconds < 120
    # ran beside it
    assert [why for why, _ in history[:1]] == ["start"] and "cpus" not in [
        why for why, _ in history
    ]
    _same_as_one_merge(toys[0], adapter, tmp_path)


@pytest.mark.slow
def test_idle_groups_filling_the_cluster_are_released_for_a_batch_merge(small_cluster, tmp_path):
    toys, adapter = small_cluster
    with JobQueue(None, idle_s=600) as queue:
        generated = [
            queue.wait(queue.submit(generate(str(toy), "two groups", tp=2)), 180) for toy in toys
        ]
        merged, seconds = timed_wait(queue, queue.submit(merge_job(toys[0], adapter, tmp_path)))
        history = list(queue.pool.history)
        events = [e.get("message", "") for e in queue.poll(merged["id"])["events"]]
    print(f"batch merge beside two pooled tp=2 groups: {seconds:.1f} s")
    assert all(r["status"] == "done" for r in generated) and merged["status"] == "done", merged
    # each group leaves a CPU, but two fill the cluster: the least recently used idle one goes
    assert [why for why, _ in history[:3]] == ["start", "start", "cpus"] and history[2][1][
        0
    ] == str(toys[0])
    assert any("released the idle worker group" in m for m in events) and seconds < 120
    _same_as_one_merge(toys[0], adapter, tmp_path)


def _same_as_one_merge(toy: Path, adapter: Path, out: Path) -> None:
    """Every output of the batch holds what one `ster merge` writes."""
    from ster_dist.adapters.merge import merge

    merge(str(toy), str(adapter), out / "reference")
    expected = _tensors(out / "reference")
    for i in range(2):
        got = _tensors(out / f"merged-{i}")
        assert got.keys() == expected.keys() and all(got[k].equal(expected[k]) for k in expected), i


def _tensors(directory: Path) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.mark.slow
def test_a_ray_group_a_job_timed_out_on_is_killed_and_its_cpus_return(small_cluster, tmp_path):
    import ray

    toys, _ = small_cluster
    toy = str(toys[0])
    held = HeldVector(tmp_path, toy)
    with JobQueue(None, idle_s=600) as queue:
        first = queue.wait(queue.submit(generate(toy, "loads the group", tp=2)), 180)
        stuck = queue.submit(
            {**held.job(toy, "stuck"), "tp": 2, "id": "stuck-on-ranks", "timeout_s": 5}
        )
        failed = queue.wait(stuck, 60)
        deadline = time.monotonic() + 30  # the ranks are killed and their placement group removed
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        freed = ray.available_resources().get("CPU", 0)
        after = queue.wait(queue.submit(generate(toy, "on a fresh group", tp=2)), 180)
        starts = queue.stats()["group_starts"]
    assert first["status"] == "done" and failed["status"] == "failed", failed
    assert (
        failed["error"].startswith("job stuck-on-ranks ran past its timeout of 5 s; ")
        and freed == 2
    )
    assert after["status"] == "done" and starts == 2
    unblock(held)
    assert thread_ends("ster-job-stuck-on-ranks")
