"""The job queue's journal: an append-only log of accepted, running and finished jobs.

A job queue that restarts on the same state directory replays it: every accepted job
without a finished record is queued again (a job that was running re-runs from the start;
its outputs are written by rename, so a re-run replaces, never doubles, them), and a finished
job is never run again. Records are fsynced (once per batch of them) before the job queue acts
on them, and a caller learns of an accepted job only after that. One queue owns a state
directory at a time (an flock the kernel drops when the process dies).

Each record is a frame: MAGIC, the payload's length, a CRC32 of length and payload, then the msgpack
payload. A frame that does not check out (a torn last write, a corrupt byte anywhere) is skipped and
replay resynchronises on the next MAGIC whose frame checks out, so one bad byte loses one record,
never the rest of the log. A job whose accepted record was lost so is never dropped silently: the
job ids still legible in the unreadable bytes, and not in any readable record, are named at restart
and by `ster queue journal` (their specs are lost: they must be submitted again). Before a journal
with unreadable bytes is compacted, the whole file is kept aside as journal.msgpack.corrupt-<time>.
A journal of plain msgpack records (before the frames) is still read, and rewritten in frames on
open.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from ster_dist.atomic import replacing
from ster_dist.errors import Refusal

KEEP_FINISHED = 2000  # finished jobs kept across compactions (their results stay answerable)
# 0xc1 is the one byte msgpack never uses: no plain-msgpack journal starts with it
MAGIC = b"\xc1SJ"
_HEAD = struct.Struct(">3sII")  # magic, payload length, crc32(length + payload)
MAX_RECORD = 256 << 20  # a longer length is a corrupt one (no job spec or result comes near it)


@dataclass
class Entry:
    spec: dict
    attempts: int = 0  # runs started, counted across restarts
    result: dict | None = None
    seq: int = 0
    broken: str | None = None  # why this journaled job cannot be trusted (it fails on recovery)


@dataclass
class State:
    entries: dict[str, Entry] = field(default_factory=dict)  # in acceptance order
    skipped: int = 0  # records replay could not read (corrupt or torn)
    skipped_bytes: int = 0
    torn_tail: bool = False  # the unreadable bytes run to the end of the file (a kill mid-append)
    malformed: list[str] = field(default_factory=list)  # readable records with wrongly typed fields
    # job ids read in unreadable records' bytes
    legible_ids: list[str] = field(default_factory=list)
    # those of them no readable record knows: accepted, then lost
    lost: list[str] = field(default_factory=list)
    old_format: bool = False

    def pending(self) -> list[tuple[str, Entry]]:
        return [(job_id, e) for job_id, e in self.entries.items() if e.result is None]


class Journal:
    def __init__(self, directory: str | os.PathLike | None, durable: bool = True):
        self.directory = Path(directory) if directory is not None else None
        self.durable = durable
        self._handle = None
        self._lock = None
        # finished records a write error kept from the file, written first next time
        self._owed: list[bytes] = []
        self.notices: list[str] = []  # what replay could not read, for the job queue to show
        if self.directory is None:
            return
        self.path = self.directory / "journal.msgpack"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.directory / "lock", "a+")
        except OSError as exc:
            raise self.refusal(exc) from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise Refusal(
                f"another job queue holds the state directory {self.directory}; stop it or give "
                "another state directory"
            ) from None

    def refusal(self, exc: OSError) -> Refusal:
        """The one-line refusal for new work while the journal cannot be written."""
        reason = exc.strerror or str(exc)
        return Refusal(
            f"the job queue cannot write its journal at {self.directory}: {reason}; free space "
            "(or make the directory writable) there and submit again"
        )

    @property
    def behind(self) -> bool:
        """Finished records wait in memory for the disk: a restart now would run those jobs
        again."""
        return bool(self._owed)

    def open(self) -> State:
        """Replay the log, keep aside what it could not read, rewrite it compacted (pending jobs and
        the latest finished ones), and keep it open for appends."""
        state = self.replay()
        if self.directory is None:
            return state
        try:
            self._keep_aside(state)
            self._rewrite(state)
            # unbuffered: a failed write leaves nothing in a buffer to reach the file later
            self._handle = open(self.path, "ab", buffering=0)
        except OSError as exc:
            self.close()  # a refused start-up leaves the state directory free for the next try
            raise self.refusal(exc) from None
        return state

    def replay(self) -> State:
        if self.directory is None:
            return State()
        return read(self.path)

    def _keep_aside(self, state: State) -> None:
        """Copy a journal with unreadable bytes aside before compaction drops them, and say so."""
        if state.skipped:
            kept = self.path.with_name(
                f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
            )
            shutil.copyfile(self.path, kept)
            what = (
                "a torn last record"
                if state.torn_tail and state.skipped == 1
                else f"{state.skipped} unreadable record(s)"
            )
            self._notice(
                f"the journal at {self.path} had {what} ({state.skipped_bytes} bytes), skipped; "
                f"the whole file is kept at {kept}"
            )
        if state.lost:
            self._notice(f"the journal at {self.path}: {lost_line(state.lost)}")
        for message in state.malformed:
            self._notice(f"the journal at {self.path}: {message}")

    def _notice(self, message: str) -> None:
        self.notices.append(message)
        # loud even with no one polling
        print(f"ster job queue: {message}", file=sys.stderr, flush=True)

    # Each append goes to the file at once; commit() makes everything appended so far durable (one
    # fsync for a whole batch of records, before the job queue acts on any of them). An OSError
    # (a full disk) reaches the caller.
    def accepted(self, job_id: str, spec: dict, seq: int) -> None:
        self._append(
            {"op": "accepted", "id": job_id, "spec": spec, "seq": seq, "time": time.time()}
        )

    def running(self, job_id: str, attempt: int) -> None:
        self._append({"op": "running", "id": job_id, "attempt": attempt, "time": time.time()})

    def finished(self, job_id: str, result: dict) -> None:
        data = frame({"op": "finished", "id": job_id, "result": result, "time": time.time()})
        if self._handle is None:
            return
        try:
            self._catch_up()
            self._write(data)
        except OSError:
            self._owed.append(data)  # never lose a result: written before any later record
            raise

    def mark(self) -> int:
        """Where the next record will start (catching up owed records first), for undo()."""
        if self._handle is None:
            return 0
        self._catch_up()
        return os.fstat(self._handle.fileno()).st_size

    def undo(self, offset: int) -> None:
        """Cut the file back to mark(): records of a submit that failed must never run later."""
        if self._handle is not None:
            os.ftruncate(self._handle.fileno(), offset)

    def _append(self, record: dict) -> None:
        if self._handle is None:
            return
        self._catch_up()
        self._write(frame(record))

    def _catch_up(self) -> None:
        while self._owed:
            self._write(self._owed[0])
            self._owed.pop(0)

    def _write(self, data: bytes) -> None:
        start = os.fstat(self._handle.fileno()).st_size
        try:
            written = self._handle.write(data)
            if written is not None and written != len(data):
                raise OSError(28, os.strerror(28))  # a short write: the disk filled mid-record
        except OSError:
            self._cut(start)
            raise

    def _cut(self, offset: int) -> None:
        """Drop a half-written frame, so the next record starts clean (replay would skip it
        anyway)."""
        try:
            os.ftruncate(self._handle.fileno(), offset)
        except OSError:
            pass

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
                out.write(frame({"op": "accepted", "id": job_id, "spec": e.spec, "seq": e.seq}))
                if e.attempts:
                    out.write(frame({"op": "running", "id": job_id, "attempt": e.attempts}))
                if e.result is not None:
                    out.write(frame({"op": "finished", "id": job_id, "result": e.result}))
        for job_id in drop:
            del state.entries[job_id]

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._lock is not None:
            self._lock.close()  # closing drops the flock
            self._lock = None


def lost_line(ids: list[str]) -> str:
    return (
        f"job id(s) {', '.join(map(repr, ids))} read only in unreadable records: accepted once, their "
        "specs are lost and they will not run; submit them again"
    )


def frame(record: dict) -> bytes:
    payload = msgpack.packb(record, use_bin_type=True)
    length = struct.pack(">I", len(payload))
    return MAGIC + length + struct.pack(">I", zlib.crc32(length + payload)) + payload


def read(path: str | os.PathLike) -> State:
    """The jobs a journal file records (read only: safe beside the job queue that owns it)."""
    state = State()
    try:
        data = _journal_bytes(Path(path))
    except FileNotFoundError:  # no journal yet: nothing accepted
        return state
    for record in records(data, state):
        _apply(state, record)
    state.lost = [
        job_id for job_id in dict.fromkeys(state.legible_ids) if job_id not in state.entries
    ]
    return state


def _journal_bytes(path: Path) -> bytes:
    # One open decides file or directory: a check then an open races a job queue creating its
    # directory.
    try:
        return path.read_bytes()
    except IsADirectoryError:
        return (path / "journal.msgpack").read_bytes()


def records(data: bytes, state: State | None = None) -> list:
    """Every record the bytes hold; `state` (when given) counts what could not be read."""
    state = state if state is not None else State()
    if data and not data.startswith(MAGIC) and _next_frame(data, 0) == len(data):
        state.old_format = True
        return _plain(data, state)
    return _frames(data, state)


def _frames(data: bytes, state: State) -> list:
    out, pos = [], 0
    while pos < len(data):
        record, end = _frame_at(data, pos)
        if end is not None:
            out.append(record)
            pos = end
            continue
        good = _next_frame(data, pos + 1)
        _skipped(state, data, pos, good)
        pos = good
    return out


def _skipped(state: State, data: bytes, start: int, end: int) -> None:
    # a stretch may hold several records: count the frame starts in it (at least one)
    state.skipped += max(1, data.count(MAGIC, start, end))
    state.skipped_bytes += end - start
    state.torn_tail = end == len(data)
    # a torn last append was never acknowledged: its job was refused, not lost
    if not state.torn_tail:
        state.legible_ids += _legible_ids(data[start:end])


_ID_KEY = b"\xa2id"  # msgpack's "id" (a record's job id, and a spec's own id field)


def _legible_ids(stretch: bytes) -> list[str]:
    """Job ids that still read in unreadable bytes: each "id" key followed by a short msgpack string
    that decodes as UTF-8 (a corrupt byte inside one id usually leaves the spec's copy of it
    legible)."""
    found, pos = [], stretch.find(_ID_KEY)
    while pos >= 0:
        at = pos + len(_ID_KEY)
        head = stretch[at : at + 2]
        if head and 0xA0 <= head[0] <= 0xBF:
            start, length = at + 1, head[0] - 0xA0
        elif len(head) == 2 and head[0] == 0xD9:
            start, length = at + 2, head[1]
        else:
            start, length = at, 0
        try:
            text = stretch[start : start + length].decode("utf-8") if length else ""
        except UnicodeDecodeError:
            text = ""
        if text and len(stretch) >= start + length and text.isprintable():
            found.append(text)
        pos = stretch.find(_ID_KEY, at)
    return found


def _frame_at(data: bytes, pos: int):
    """(record, end) for a frame at pos that checks out, else (None, None)."""
    if len(data) - pos < _HEAD.size:
        return None, None
    magic, length, crc = _HEAD.unpack_from(data, pos)
    end = pos + _HEAD.size + length
    if magic != MAGIC or length > MAX_RECORD or end > len(data):
        return None, None
    payload = data[pos + _HEAD.size : end]
    if zlib.crc32(data[pos + 3 : pos + 7] + payload) != crc:
        return None, None
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True), end
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None, None


def _next_frame(data: bytes, pos: int) -> int:
    """Where the next frame that checks out starts (resynchronising after a bad one), or the end."""
    while True:
        pos = data.find(MAGIC, pos)
        if pos < 0:
            return len(data)
        if _frame_at(data, pos)[1] is not None:
            return pos
        pos += 1


def _plain(data: bytes, state: State) -> list:
    """An old journal of plain msgpack records: no frame to resynchronise on, so everything from the
    first unreadable byte on counts as skipped (and is kept aside before the rewrite)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    out, pos = [], 0
    while pos < len(data):
        try:
            out.append(unpacker.unpack())
        except (msgpack.OutOfData, msgpack.FormatError, msgpack.StackError, ValueError):
            _skipped(state, data, pos, len(data))
            break
        pos = unpacker.tell()
    return out


def _apply(state: State, record) -> None:
    if not isinstance(record, dict):
        state.malformed.append(f"a record is {type(record).__name__}, not a mapping; skipped")
        return
    job_id, op = record.get("id"), record.get("op")
    if not isinstance(job_id, str):
        state.malformed.append(
            f"a {op!r} record has a job id of type {type(job_id).__name__} "
            f"({job_id!r}), not a string; skipped"
        )
        return
    if op == "accepted" and job_id not in state.entries:
        state.entries[job_id] = _accepted(state, job_id, record)
    elif job_id not in state.entries:
        return
    elif op == "running":
        _running(state, job_id, record)
    elif op == "finished" and state.entries[job_id].result is None:
        _finished(state, job_id, record)


def _accepted(state: State, job_id: str, record: dict) -> Entry:
    spec, seq = record.get("spec"), record.get("seq") or 0
    if not isinstance(seq, int):
        state.malformed.append(f"job {job_id}: its seq {seq!r} is not an integer; queued last")
        seq = 0
    if not isinstance(spec, dict):
        why = f"its journaled spec is a {type(spec).__name__}, not a mapping; not run"
        state.malformed.append(f"job {job_id}: {why}")
        return Entry({}, seq=seq, broken=why)
    return Entry(spec, seq=seq)


def _running(state: State, job_id: str, record: dict) -> None:
    attempt = record.get("attempt") or 0
    if not isinstance(attempt, int):
        state.malformed.append(
            f"job {job_id}: an attempt count {attempt!r} is not an integer; ignored"
        )
        return
    entry = state.entries[job_id]
    entry.attempts = max(entry.attempts, attempt)


def _finished(state: State, job_id: str, record: dict) -> None:
    result = record.get("result")
    if not isinstance(result, dict) or not isinstance(result.get("status", "done"), str):
        why = f"its journaled result is unreadable ({type(result).__name__}); not run again"
        state.malformed.append(f"job {job_id}: {why}")
        state.entries[job_id].broken = why
        return
    state.entries[job_id].result = result
