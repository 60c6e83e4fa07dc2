"""The job queue's journal: an append-only msgpack log of accepted, running and finished jobs.

A job queue that restarts on the same state directory replays it: every accepted job
without a finished record is queued again (a job that was running re-runs from the start;
its outputs are written by rename, so a re-run replaces, never doubles, them), and a finished
job is never run again. Records are fsynced (once per batch of them) before the job queue acts
on them, and a caller learns of an accepted job only after that. A process killed mid-append
leaves at most a torn last record, which replay cuts off. One queue owns a state
directory at a time (an flock the kernel drops when the process dies).
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from ster_dist.atomic import replacing
from ster_dist.errors import Refusal

KEEP_FINISHED = 2000  # finished jobs kept across compactions (their results stay answerable)


@dataclass
class Entry:
    spec: dict
    attempts: int = 0  # runs started, counted across restarts
    result: dict | None = None
    seq: int = 0


@dataclass
class State:
    entries: dict[str, Entry] = field(default_factory=dict)  # in acceptance order

    def pending(self) -> list[tuple[str, Entry]]:
        return [(job_id, e) for job_id, e in self.entries.items() if e.result is None]


class Journal:
    def __init__(self, directory: str | os.PathLike | None, durable: bool = True):
        self.directory = Path(directory) if directory is not None else None
        self.durable = durable
        self._handle = None
        self._lock = None
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "journal.msgpack"
        self._lock = open(self.directory / "lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise Refusal(f"another job queue holds the state directory {self.directory}; stop it or give "
                          "another state directory") from None

    def open(self) -> State:
        """Replay the log, rewrite it compacted (pending jobs and the latest finished ones), and keep
        it open for appends."""
        state = self.replay()
        if self.directory is not None:
            self._rewrite(state)
            self._handle = open(self.path, "ab")
        return state

    def replay(self) -> State:
        if self.directory is None:
            return State()
        return read(self.path)

    # Each append is written and flushed at once; commit() makes everything appended so far
    # durable (one fsync for a whole batch of records, before the job queue acts on any of them).
    def accepted(self, job_id: str, spec: dict, seq: int) -> None:
        self._append({"op": "accepted", "id": job_id, "spec": spec, "seq": seq, "time": time.time()})

    def running(self, job_id: str, attempt: int) -> None:
        self._append({"op": "running", "id": job_id, "attempt": attempt, "time": time.time()})

    def finished(self, job_id: str, result: dict) -> None:
        self._append({"op": "finished", "id": job_id, "result": result, "time": time.time()})

    def _append(self, record: dict) -> None:
        if self._handle is None:
            return
        self._handle.write(msgpack.packb(record, use_bin_type=True))
        self._handle.flush()

    def commit(self) -> None:
        if self._handle is not None and self.durable:
            os.fsync(self._handle.fileno())

    def _rewrite(self, state: State) -> None:
        finished = [k for k, e in state.entries.items() if e.result is not None]
        drop = set(finished[:-KEEP_FINISHED]) if len(finished) > KEEP_FINISHED else set()
        with replacing(self.path, binary=True, durable=True) as out:
            for job_id, e in state.entries.items():
                if job_id in drop:
                    continue
                out.write(msgpack.packb({"op": "accepted", "id": job_id, "spec": e.spec, "seq": e.seq},
                                        use_bin_type=True))
                if e.attempts:
                    out.write(msgpack.packb({"op": "running", "id": job_id, "attempt": e.attempts},
                                            use_bin_type=True))
                if e.result is not None:
                    out.write(msgpack.packb({"op": "finished", "id": job_id, "result": e.result},
                                            use_bin_type=True))
        for job_id in drop:
            del state.entries[job_id]

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._lock is not None:
            self._lock.close()  # closing drops the flock
            self._lock = None


def read(path: str | os.PathLike) -> State:
    """The jobs a journal file records (read only: safe beside the job queue that owns it)."""
    state = State()
    path = Path(path)
    if path.is_dir():
        path = path / "journal.msgpack"
    if not path.exists():
        return state
    with open(path, "rb") as handle:
        unpacker = msgpack.Unpacker(handle, raw=False, strict_map_key=True)
        while True:
            try:
                record = unpacker.unpack()
            except msgpack.OutOfData:
                break  # the end, or a record torn by a kill mid-append: nothing after it was acted on
            except (msgpack.FormatError, msgpack.StackError, ValueError):
                break
            _apply(state, record)
    return state


def _apply(state: State, record) -> None:
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return
    job_id, op = record["id"], record.get("op")
    if op == "accepted" and job_id not in state.entries and isinstance(record.get("spec"), dict):
        state.entries[job_id] = Entry(record["spec"], seq=int(record.get("seq") or 0))
    elif job_id not in state.entries:
        return
    elif op == "running":
        entry = state.entries[job_id]
        entry.attempts = max(entry.attempts, int(record.get("attempt") or 0))
    elif op == "finished" and state.entries[job_id].result is None:
        state.entries[job_id].result = record.get("result")
