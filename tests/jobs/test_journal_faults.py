"""Faults the job queue's journal must survive (issue 19), each injected for real: bytes corrupted
on disk, a torn append, a write that fails with ENOSPC (the journal file's handle write replaced:
a real full disk cannot be made here, and root ignores an unwritable directory), malformed
records written by hand. Real files, real JobQueue instances, the toy model where a job runs."""

from __future__ import annotations

import errno
import json
import shutil
import threading
from pathlib import Path

import msgpack
import pytest

from ster_dist.cli import main
from ster_dist.errors import Refusal
from ster_dist.jobqueue.journal import read
from ster_dist.jobqueue.queue import JobQueue
from tests.cli_run import make_toy


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def spec(toy, name, **fields) -> dict:
    return {
        "kind": "generate",
        "model": toy,
        "prompt": name,
        "max_new_tokens": 2,
        "chat_template": "off",
        "id": name,
        **fields,
    }


def journal(state: Path) -> Path:
    return state / "journal.msgpack"


def accepted_journal(toy, state: Path, n: int, finished: int = 0) -> list[str]:
    """A journal with `finished` jobs run to the end, then n - finished jobs only accepted."""
    names = [f"job-{i:02d}" for i in range(n)]
    with JobQueue(state) as queue:
        for name in names[:finished]:
            queue.wait(queue.submit(spec(toy, name)), 60)
    queue = JobQueue(state)  # never started: the rest stay accepted
    queue.submit_many([spec(toy, name) for name in names[finished:]])
    queue.close()
    return names


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# -- 1. a corrupt byte ----------------------------------------------------------------------------


def test_one_corrupt_byte_mid_journal_loses_one_record_not_every_later_job(toy, tmp_path, capfd):
    state = tmp_path / "state"
    names = accepted_journal(toy, state, 12, finished=3)
    original = journal(state).read_bytes()
    flip(journal(state), original.find(b"job-07"))  # inside job-07's accepted record, mid-file
    # read before the restart, `ster queue journal` names the job whose accepted record is
    # unreadable
    assert main(["queue", "journal", "--state", str(state)]) == 0
    report = json.loads(capfd.readouterr().out)
    assert report["unreadable"]["lost_jobs"] == ["job-07"]
    assert {"id": "job-07", "status": "lost"}.items() <= next(
        j for j in report["jobs"] if j["id"] == "job-07"
    ).items()
    with JobQueue(state) as queue:
        known = set(queue.jobs)
        err = capfd.readouterr().err
        # replay went on past the hit record, and its job is not dropped silently
        assert known == set(names)
        lost = queue.wait("job-07", 1)  # its spec is gone: it fails, saying why
        assert (
            lost["status"] == "failed"
            and "job-07" in lost["error"]
            and "unreadable" in lost["error"]
        )
        for name in names[:3]:  # finished before: not run again
            assert queue.poll(name)["result"]["status"] == "done" and not queue.jobs[name].events
        results = [queue.wait(name, 120) for name in sorted(known - {"job-07"})]
    assert all(r["status"] == "done" for r in results)
    assert "unreadable record" in err and "skipped" in err and "kept at" in err
    assert "'job-07' read only in unreadable records" in err  # named at the restart
    kept = list(state.glob("journal.msgpack.corrupt-*"))
    # the unreadable bytes kept aside
    assert len(kept) == 1 and len(kept[0].read_bytes()) == len(original)
    # the rewritten journal holds every job the restart knew, and a second restart reads it clean
    again = read(state)
    assert set(again.entries) == known and again.skipped == 0


def test_a_corrupt_byte_anywhere_costs_at_most_one_record(toy, tmp_path):
    """Every 5th byte of a journal flipped in turn (each on a fresh copy): replay never loses more
    than the one job whose record the byte hit, never reports a finished job unfinished except
    that one, and never invents one."""
    state = tmp_path / "state"
    names = accepted_journal(toy, state, 8, finished=2)
    original = journal(state).read_bytes()
    clean = read(state).entries
    injected = survived = 0
    for offset in range(0, len(original), 5):
        copy = tmp_path / f"copy-{offset}"
        copy.mkdir()
        data = bytearray(original)
        data[offset] ^= 0x5A
        journal(copy).write_bytes(bytes(data))
        injected += 1
        entries = read(copy).entries
        lost = set(names) - set(entries)
        changed = {k for k, e in entries.items() if (e.result is None) != (clean[k].result is None)}
        assert set(entries) <= set(names) and len(lost | changed) <= 1, (offset, lost, changed)
        survived += 1
        shutil.rmtree(copy)
    assert injected == survived and injected >= 100


def test_a_corrupt_journal_restarts_through_the_queue_every_time(toy, tmp_path):
    """Several bytes at once, at spread offsets: the queue starts, says what it skipped, and keeps
    every job of the records it could read."""
    state = tmp_path / "state"
    names = accepted_journal(toy, state, 10)
    size = len(journal(state).read_bytes())
    for offset in (size // 5, size // 2, 4 * size // 5):
        flip(journal(state), offset)
    queue = JobQueue(state)
    try:
        assert len(queue.jobs) >= len(names) - 3 and names[-1] in queue.jobs
        assert (
            queue.stats()["journal_notices"]
            and "unreadable record" in queue.stats()["journal_notices"][0]
        )
    finally:
        queue.close()


def test_a_torn_append_is_cut_off_and_kept_aside(toy, tmp_path):
    state = tmp_path / "state"
    accepted_journal(toy, state, 3)
    data = journal(state).read_bytes()
    journal(state).write_bytes(data[:-7])  # the last record torn by a kill mid-append
    queue = JobQueue(state)
    try:
        assert set(queue.jobs) == {"job-00", "job-01"}
        assert any("torn last record" in n for n in queue.journal.notices)
    finally:
        queue.close()
    assert list(state.glob("journal.msgpack.corrupt-*"))


def test_an_old_plain_msgpack_journal_is_read_and_migrated(toy, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    old = b"".join(
        msgpack.packb(r, use_bin_type=True)
        for r in [
            {"op": "accepted", "id": "old-1", "spec": spec(toy, "old-1"), "seq": 1},
            {"op": "accepted", "id": "old-2", "spec": spec(toy, "old-2"), "seq": 2},
            {"op": "running", "id": "old-1", "attempt": 1},
            {
                "op": "finished",
                "id": "old-1",
                "result": {
                    "id": "old-1",
                    "kind": "generate",
                    "status": "done",
                    "result": {},
                    "error": None,
                    "attempts": 1,
                    "exit_code": 0,
                    "batch": 1,
                },
            },
        ]
    )
    journal(state).write_bytes(old)
    with JobQueue(state) as queue:
        assert queue.poll("old-1")["result"]["status"] == "done"
        assert queue.wait("old-2", 60)["status"] == "done"
    assert not journal(state).read_bytes().startswith(old[:8])  # rewritten in the new format
    assert read(state).entries["old-2"].result["status"] == "done"


# -- 2. a full disk -------------------------------------------------------------------------------


def full_disk(queue: JobQueue, partial: bool = False):
    """Make the journal's file handle fail every write with ENOSPC (first writing half the bytes
    when `partial`: a disk that filled mid-record). Returns the function that frees the disk."""
    handle = queue.journal._handle
    real = handle.write

    def write(data):
        if partial:
            real(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    handle.write = write
    return lambda: setattr(handle, "write", real)


def test_a_full_disk_refuses_submits_in_one_line_and_a_refused_job_never_runs(toy, tmp_path):
    state = tmp_path / "state"
    with JobQueue(state) as queue:
        free = full_disk(queue, partial=True)
        for name in ("refused-1", "refused-2"):
            with pytest.raises(Refusal) as refused:
                queue.submit(spec(toy, name))
            message = str(refused.value)
            assert (
                message.startswith(
                    f"the job queue cannot write its journal at {state}: No space left on device; "
                    "free space"
                )
                and "\n" not in message
            )
            with pytest.raises(Refusal, match="no job 'refused"):
                queue.poll(name)
        free()
        # alive and accepting again
        assert queue.wait(queue.submit(spec(toy, "after")), 60)["status"] == "done"
        assert queue._thread.is_alive()
    entries = read(state).entries
    # the half-written records were cut
    assert set(entries) == {"after"} and read(state).skipped == 0
    with JobQueue(state) as again:
        assert set(again.jobs) == {"after"}


def test_a_result_the_disk_cannot_take_still_reaches_the_caller_and_the_queue_goes_on(
    toy, tmp_path
):
    state = tmp_path / "state"
    queue = JobQueue(state)
    first = queue.submit(spec(toy, "first"))
    free = full_disk(queue)
    with queue.start():
        result = queue.wait(first, 60)
        assert result["status"] == "done"
        messages = [e["message"] for e in queue.poll(first)["events"]]
        assert any(
            "the journal is behind" in m and "No space left on device" in m for m in messages
        )
        assert queue.stats()["journal_behind"] and queue._thread.is_alive()
        with pytest.raises(Refusal, match="cannot write its journal"):
            queue.submit(spec(toy, "while-full"))
        free()
        second = queue.submit(spec(toy, "second"))  # writes the owed result first
        assert queue.wait(second, 60)["status"] == "done" and not queue.stats()["journal_behind"]
    entries = read(state).entries
    assert entries["first"].result["status"] == "done" and set(entries) == {"first", "second"}


def test_a_full_disk_while_jobs_wait_keeps_every_waiter_answered(toy, tmp_path):
    """Several callers waiting on jobs that finish while no journal write succeeds: each gets its
    result; none hangs."""
    queue = JobQueue(tmp_path / "state")
    ids = queue.submit_many([spec(toy, f"w-{i}") for i in range(4)])
    full_disk(queue)
    results: dict[str, dict] = {}
    waiters = [
        threading.Thread(target=lambda i=i: results.setdefault(i, queue.wait(i, 60))) for i in ids
    ]
    with queue.start():
        for w in waiters:
            w.start()
        for w in waiters:
            w.join(90)
    assert sorted(results) == sorted(ids) and all(r["status"] == "done" for r in results.values())


# -- 3. recovery that gives up, malformed entries
# ---------------------------------------------------


def plain_journal(state: Path, records: list[dict]) -> None:
    state.mkdir(parents=True, exist_ok=True)
    journal(state).write_bytes(b"".join(msgpack.packb(r, use_bin_type=True) for r in records))


def test_a_restart_that_gives_up_on_a_job_fails_it_instead_of_crashing(toy, tmp_path):
    state = tmp_path / "state"
    plain_journal(
        state,
        [
            {
                "op": "accepted",
                "id": "bogus",
                "spec": {"kind": "steer-bogus", "id": "bogus"},
                "seq": 1,
            },
            {"op": "accepted", "id": "tired", "spec": spec(toy, "tired"), "seq": 2},
            {"op": "running", "id": "tired", "attempt": 9},
            {"op": "accepted", "id": "fine", "spec": spec(toy, "fine"), "seq": 3},
        ],
    )
    with JobQueue(state) as queue:
        assert queue.poll("bogus")["result"]["status"] == "failed"
        assert "no longer a valid job" in queue.poll("bogus")["result"]["error"]
        assert "not retried again" in queue.poll("tired")["result"]["error"]
        assert queue.wait("fine", 60)["status"] == "done"
    with JobQueue(state) as again:  # the give-ups were journaled: a second restart says the same
        assert again.poll("tired")["result"]["status"] == "failed"


def test_wrongly_typed_journal_fields_fail_or_skip_their_job_with_a_message(toy, tmp_path, capfd):
    state = tmp_path / "state"
    plain_journal(
        state,
        [
            {"op": "accepted", "id": 7, "spec": spec(toy, "int-id"), "seq": 1},
            {"op": "accepted", "id": "list-spec", "spec": ["generate", toy], "seq": 2},
            {"op": "accepted", "id": "str-attempts", "spec": spec(toy, "str-attempts"), "seq": 3},
            {"op": "running", "id": "str-attempts", "attempt": "three"},
            {"op": "accepted", "id": "str-seq", "spec": spec(toy, "str-seq"), "seq": "four"},
            {"op": "accepted", "id": "bad-result", "spec": spec(toy, "bad-result"), "seq": 5},
            {"op": "finished", "id": "bad-result", "result": ["done"]},
            {"op": "accepted", "id": "fine", "spec": spec(toy, "fine"), "seq": 6},
            "not even a mapping",
        ],
    )
    with JobQueue(state) as queue:
        assert queue.poll("list-spec")["result"]["status"] == "failed"
        assert "spec is a list" in queue.poll("list-spec")["result"]["error"]
        assert queue.poll("bad-result")["result"]["status"] == "failed"  # never run again
        for name in ("str-attempts", "str-seq", "fine"):
            assert queue.wait(name, 60)["status"] == "done"
        assert 7 not in queue.jobs and "int-id" not in queue.jobs
    err = capfd.readouterr().err
    assert "Traceback" not in err
    for words in (
        "job id of type int",
        "spec is a list",
        "'three' is not an integer",
        "'four' is not an integer",
        "result is unreadable",
        "not a mapping",
    ):
        assert words in err, words


def test_reading_beside_a_queue_that_is_still_creating_its_state_sees_no_jobs(toy, tmp_path):
    # A reader polls a state path the queue has not made yet, then one with no journal yet, then the
    # journal.
    state = tmp_path / "state"
    assert read(state).entries == {}
    state.mkdir()
    assert read(state).entries == {}
    with JobQueue(state) as scheduler:
        scheduler.wait(
            scheduler.submit(
                {
                    "kind": "generate",
                    "model": toy,
                    "prompt": "hi",
                    "max_new_tokens": 2,
                    "chat_template": "off",
                    "id": "one",
                }
            ),
            60,
        )
    assert read(state).entries["one"].result is not None
    assert read(state / "journal.msgpack").entries.keys() == {"one"}


def test_finished_jobs_leave_memory_past_keep_finished_and_stay_in_the_journal(toy, tmp_path):
    state = tmp_path / "state"
    names = [f"kept-{i}" for i in range(5)]
    with JobQueue(state, keep_finished=2) as queue:
        for name in names:
            assert queue.wait(queue.submit(spec(toy, name)), 60)["status"] == "done"
        in_memory, stats = set(queue.jobs), queue.stats()
        with pytest.raises(Refusal, match="kept only in the journal"):
            queue.poll("kept-0")
    assert in_memory == set(names[-2:]) and stats["forgotten"] == 3
    assert {k for k, e in read(state).entries.items() if e.result is not None} == set(names)
    with JobQueue(state, keep_finished=2) as again:  # a restart holds no more of them either
        assert set(again.jobs) == set(names[-2:])
