"""The central queue: the one owner of worker groups, and the queue every job goes through.

Jobs of every kind (generate, extract, steer train/evaluate/optimize, decide, merge, parity, tune)
are validated on arrival (ster_dist.protocol: a typed request per job), journaled
(jobqueue/journal.py), queued by priority (higher first, then arrival order) and run one at a time
by one executor thread, each as its operation (ster_dist.ops) over a session from the pool of worker
groups (jobqueue/pool.py), so a model is loaded once and reused by every later job on the same group
key. Generate jobs run in lanes beside the executor, each its own job, all feeding the one token
engine of their group (their engine request ids carry their job ids: ster_dist/running.py), so a
generate job arriving mid-generation joins the running batch at the next step, and continuous
batching shares the forwards; other kinds wait for the lanes and run alone. A job is cancelled
(`cancel`) at its next engine step, or dropped from the queue if it has not started. A job whose
worker died is retried on a restarted group up to `max_retries` times, then fails with the worker's
error. Finished jobs stay in memory up to `keep_finished` of them (the oldest dropped first); the
journal keeps them. Every attempt runs on a thread of its own (jobqueue/watch.py), so a job that
runs past its timeout (its spec's `timeout_s`, else the queue's
`job_timeout`) is failed and abandoned with its worker group, and the next job runs. Progress
events are kept per job (jobqueue/events.py) for callers to stream; results are protocol result
records.

The same class runs in-process (the Python API, `ster submit --local`) and inside the named
Ray actor (jobqueue/actor.py) that `ray job submit ... jobs/run.py` and `ster submit` reach.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from ster_dist import ops, protocol
from ster_dist.errors import OutOfMemory, Refusal, WorkerLost
from ster_dist.jobqueue import events
from ster_dist.jobqueue.journal import Entry, Journal, lost_line
from ster_dist.jobqueue.pool import GroupPool
from ster_dist.jobqueue.watch import Attempt
from ster_dist.protocol import JobSpec
from ster_dist.running import Cancelled, JobContext, job_scope
from ster_dist.schema import GenerateRequest

MAX_EVENTS = 1000  # per job; the oldest are dropped past this
_ACTIVE: list[JobQueue] = []


@dataclass(frozen=True)
class RawSpec:
    """A journaled job that no longer validates (or already finished): kept by id and kind only."""

    id: str
    kind: str
    priority: int
    spec: dict

    def to_dict(self) -> dict:
        return self.spec

    @property
    def timeout_s(self):
        return self.spec.get("timeout_s")

    @property
    def fields(self) -> dict:
        return {k: v for k, v in self.spec.items() if k not in protocol.PROTOCOL_FIELDS}


@dataclass
class Job:
    spec: JobSpec | RawSpec
    seq: int
    # a generate job's (group key, engine options): lanes run only on one at a time
    lane: tuple | None = None
    attempts: int = 0
    state: str = "queued"  # queued | running | done | failed | cancelled
    context: JobContext | None = None  # its id for engine requests, and its cancellation
    events: list = field(default_factory=list)
    dropped: int = 0  # events dropped from the front (cursors count them)
    result: dict | None = None


class JobQueue:
    def __init__(
        self,
        state_dir=None,
        *,
        address: str | None = None,
        idle_s: float = 300.0,
        max_retries: int = 2,
        max_groups: int = 4,
        durable: bool = True,
        max_lanes: int = 8,
        job_timeout: float | None = None,
        keep_finished: int = 10000,
    ):
        if job_timeout is not None and not job_timeout > 0:
            raise Refusal(
                f"the job queue's job_timeout must be a number of seconds above 0 (or None), "
                f"got {job_timeout!r}"
            )
        self.max_retries = max_retries
        # seconds a job without its own timeout_s may run; None: no limit
        self.job_timeout = job_timeout
        if keep_finished < 0:
            raise Refusal(f"the job queue's keep_finished must be 0 or more, got {keep_finished!r}")
        self.max_lanes = max_lanes
        # finished jobs kept in memory (the journal keeps them all)
        self.keep_finished = keep_finished
        self._finished: collections.deque[str] = collections.deque()
        self.forgotten = 0  # finished jobs dropped from memory
        self._lanes: set[threading.Thread] = set()
        self._lane_key: tuple | None = None  # the (group, engine options) the running lanes share
        self.lanes_peak = 0  # the most generate jobs that ran at once, for tests and benchmarks
        self._running: dict[Attempt, list[Job]] = {}  # attempts being waited for, and their jobs
        self.pool = GroupPool(address, idle_s, max_groups)
        self.journal = Journal(state_dir, durable)
        self.jobs: dict[str, Job] = {}
        self._queue: list[tuple[int, int, str]] = []
        self._cond = threading.Condition()
        self._seq = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        state = self.journal.open()
        with self._cond:  # recovery finishes jobs, and finishing notifies waiters under the lock
            self._recover(state)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> JobQueue:
        if _ACTIVE and _ACTIVE[0] is not self:
            raise Refusal(
                "a job queue is already running in this process; close it or submit to it"
            )
        if self._thread is None:
            _ACTIVE[:] = [self]
            self._thread = threading.Thread(target=self._loop, name="ster-queue", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 600.0) -> None:
        """Stop after the running job (queued jobs stay accepted in the journal), release every
        group."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._wait_lanes(timeout)
        if _ACTIVE and _ACTIVE[0] is self:
            _ACTIVE.clear()
        self.pool.close()
        self.journal.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # -- what callers use ------------------------------------------------------------------------
    def submit(self, spec) -> str:
        return self.submit_many([spec])[0]

    def submit_many(self, specs: list, cli: bool = False) -> list[str]:
        """Validate every spec first (one refused: none accepted), then journal and queue them all.
        `cli`: the specs are command lines of this process, refused in their flags' words."""
        return self.submit_jobs([protocol.validate(spec, cli=cli) for spec in specs])

    def submit_jobs(self, jobs: list[JobSpec]) -> list[str]:
        """Journal and queue jobs already validated (a command line's typed request)."""
        ids, new = [], []
        with self._cond:
            for spec in jobs:
                known = (
                    self.jobs[spec.id].spec
                    if spec.id in self.jobs
                    else next((s for s in new if s.id == spec.id), None)
                )  # or sent twice in this batch
                if known is not None:
                    if _same(known, spec):
                        # a client resending after a restart: already here, once
                        ids.append(spec.id)
                        continue
                    raise Refusal(
                        f"job id {spec.id!r} is already taken by another job; give a new id"
                    )
                new.append(spec)
                ids.append(spec.id)
            # journaled (and durable) before the caller hears the ids or the executor sees the jobs;
            # a batch the journal cannot hold is cut from it again and refused whole: it never runs
            seqs = self._journal_accepted(new)
            for spec, seq in zip(new, seqs):
                job = self._accept(spec, seq=seq)
                self._note(
                    job,
                    events.event(f"accepted {spec.kind} job {spec.id}", position=len(self._queue)),
                )
            self._cond.notify_all()
        return ids

    def _journal_accepted(self, specs: list[JobSpec]) -> list[int]:
        """Journal a batch of new jobs and fsync it: their seqs, or a Refusal with nothing kept."""
        seqs = list(range(self._seq + 1, self._seq + 1 + len(specs)))
        if not specs:
            return seqs
        offset = None
        try:
            offset = self.journal.mark()
            for spec, seq in zip(specs, seqs):
                self.journal.accepted(spec.id, spec.to_dict(), seq)
            self.journal.commit()
        except OSError as exc:
            if offset is not None:
                self._undo(offset)
            raise self.journal.refusal(exc) from None
        return seqs

    def _undo(self, offset: int) -> None:
        try:
            self.journal.undo(offset)
        except OSError as exc:  # the file keeps records of a refused batch: say so, loudly
            print(
                f"ster job queue: could not cut refused jobs from the journal at {self.journal.directory} "
                f"({exc}); a restart may run them",
                file=sys.stderr,
                flush=True,
            )

    def poll(self, job_id: str, cursor: int = 0, timeout: float = 0.0) -> dict:
        """The job's state, its events from `cursor` on, and its result once finished. With a
        timeout, waits up to that long for something new."""
        return self.poll_many({job_id: cursor}, timeout)[job_id]

    def poll_many(self, cursors: dict[str, int], timeout: float = 0.0) -> dict[str, dict]:
        """poll() for several jobs at once, waiting (up to timeout) until any of them has news."""
        deadline = time.monotonic() + timeout
        with self._cond:
            jobs = {job_id: self._job(job_id) for job_id in cursors}

            def news() -> bool:
                return any(
                    j.dropped + len(j.events) > cursors[i] or j.result is not None
                    for i, j in jobs.items()
                )

            while not news() and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return {
                job_id: {
                    "id": job_id,
                    "state": j.state,
                    "events": list(j.events[max(0, cursors[job_id] - j.dropped) :]),
                    "cursor": j.dropped + len(j.events),
                    "result": j.result,
                }
                for job_id, j in jobs.items()
            }

    def wait(self, job_id: str, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            job = self._job(job_id)
            while job.result is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
                self._cond.wait(left)
            return job.result

    def cancel(self, job_id: str, reason: str = "cancelled on request") -> dict:
        """Cancel a job: a queued one never runs; a running one stops at its next step (a generate
        job's engine requests are aborted and their KV blocks freed; its output is not written) and
        is journaled `cancelled`; a finished one stays as it finished. Its state after the call."""
        with self._cond:
            job = self._job(job_id)
            if job.result is None:
                queued = [entry for entry in self._queue if entry[2] == job_id]
                if queued or job.state == "queued":
                    self._queue = [entry for entry in self._queue if entry[2] != job_id]
                    heapq.heapify(self._queue)
                    # a job whose group is being found right now stops there
                    job.context.cancel(reason)
                    self._finish(
                        job,
                        protocol.make_result(
                            job.spec,
                            "cancelled",
                            error=f"{reason} before it ran",
                            attempts=job.attempts,
                            exit_code=130,
                        ),
                    )
                else:
                    self._note(job, events.event(f"cancelling: {reason}", notice=True))
            self._cond.notify_all()
        if job.result is None:
            job.context.cancel(reason)  # outside the queue's lock: it reaches into the token engine
        return {"id": job_id, "state": job.state}

    def stats(self) -> dict:
        groups = self.pool.describe()  # outside the queue's lock: a group may be loading
        with self._cond:
            states: dict[str, int] = {}
            for job in self.jobs.values():
                states[job.state] = states.get(job.state, 0) + 1
            return {
                "queued": len(self._queue),
                "jobs": states,
                "group_starts": self.pool.starts,
                "group_releases": self.pool.releases,
                "groups": groups,
                "lanes_peak": self.lanes_peak,
                "forgotten": self.forgotten,
                "journal_behind": self.journal.behind,
                "journal_notices": list(self.journal.notices),
            }

    # -- inside ----------------------------------------------------------------------------------
    def _job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            past = (
                f"; finished jobs past the latest {self.keep_finished} are kept only in the journal "
                "(`ster queue journal`)"
                if self.forgotten
                else ""
            )
            raise Refusal(f"no job {job_id!r} is known to this queue{past}")
        return job

    def _accept(self, spec: JobSpec, attempts: int = 0, seq: int | None = None) -> Job:
        if seq is None:
            self._seq += 1
            seq = self._seq
        self._seq = max(self._seq, seq)
        job = Job(spec, seq, attempts=attempts, context=JobContext(spec.id))
        request = spec.request
        job.lane = (
            (request.group_key(), request.engine_options())
            if isinstance(request, GenerateRequest)
            else None
        )
        self.jobs[spec.id] = job
        heapq.heappush(self._queue, (-spec.priority, seq, spec.id))
        return job

    def _recover(self, state) -> None:
        """Queue again every accepted job the journal has no result for; keep the finished ones'
        results."""
        for job_id, entry in sorted(state.entries.items(), key=lambda item: item[1].seq):
            if entry.broken is not None:
                self._finish_recovered(
                    job_id, entry, f"the journal entry is malformed: {entry.broken}"
                )
                continue
            if entry.result is not None:
                job = Job(
                    raw_spec(job_id, entry.spec),
                    entry.seq,
                    attempts=entry.attempts,
                    result=entry.result,
                )
                job.state = entry.result.get("status", "done")
                self.jobs[job_id] = job
                self._seq = max(self._seq, entry.seq)
                self._forget_past(job)
                continue
            try:
                spec = protocol.validate(entry.spec, check_model=False)
            except Refusal as refusal:
                self._finish_recovered(
                    job_id, entry, f"no longer a valid job in this build: {refusal}"
                )
                continue
            # a journaled spec no validator foresaw: fail it, never the start-up
            except Exception as exc:
                self._finish_recovered(
                    job_id, entry, f"the journal entry is malformed: {type(exc).__name__}: {exc}"
                )
                continue
            if entry.attempts > self.max_retries:
                self._finish_recovered(
                    job_id,
                    entry,
                    f"the job queue stopped during each of its "
                    f"{entry.attempts} attempts; not retried again",
                )
                continue
            job = self._accept(spec, entry.attempts, entry.seq)
            self._note(
                job,
                events.event(
                    f"re-queued after a job queue restart ({entry.attempts} earlier attempt(s))"
                ),
            )
        self._report_lost(state.lost)

    def _report_lost(self, lost: list[str]) -> None:
        """Jobs whose accepted record was unreadable (their ids legible in its bytes): failed,
        journaled again with their error, so a client waiting on one hears why instead of 'no such
        job'."""
        for job_id in lost:
            if job_id in self.jobs:
                continue
            self._seq += 1
            if self._journal(None, self.journal.accepted, job_id, {"id": job_id}, self._seq):
                self._finish_recovered(
                    job_id,
                    Entry({"id": job_id}, seq=self._seq),
                    f"job {job_id}: {lost_line([job_id])}",
                )

    def _finish_recovered(self, job_id: str, entry, error: str) -> None:
        spec = raw_spec(job_id, entry.spec)
        job = Job(spec, entry.seq, attempts=entry.attempts)
        self.jobs[job_id] = job
        self._finish(
            job,
            protocol.make_result(
                spec, "failed", error=error, attempts=max(1, entry.attempts), exit_code=2
            ),
        )

    def _note(self, job: Job, event_: dict) -> None:
        job.events.append(event_)
        if len(job.events) > MAX_EVENTS:
            extra = len(job.events) - MAX_EVENTS
            del job.events[:extra]
            job.dropped += extra

    def _loop(self) -> None:
        tick = max(0.05, min(1.0, self.pool.idle_s / 4))
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait(tick)
                    if not self._lanes:
                        self.pool.release_idle()
                if self._stopping:
                    return
                _, _, job_id = heapq.heappop(self._queue)
                job = self.jobs[job_id]
            try:
                self._execute(job)
                if not self._lanes:
                    self.pool.release_idle()
            except Exception as exc:  # the executor outlives any one job's bookkeeping failure
                print(
                    f"ster job queue: job {job_id}: {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
                with self._cond:
                    if job.result is None:
                        job.result = protocol.make_result(
                            job.spec,
                            "failed",
                            error=f"{type(exc).__name__}: {exc}",
                            attempts=max(1, job.attempts),
                            exit_code=1,
                        )
                        job.state = "failed"
                    self._cond.notify_all()

    def _execute(self, job: Job) -> None:
        if job.lane is not None:
            if job.lane != self._lane_key:
                # another group or other engine options: its engine may be rebuilt or its group
                # evicted,
                # never under a lane still generating on them
                self._wait_lanes()
            # Load (or find) the group first, on this thread: a later job waits for the load, not
            # beside it
            if not self._attempt([job], warm_only=True):
                return
            self._lane_key = job.lane
            self._start_lane([job])
            return
        self._wait_lanes()
        self._attempt([job])

    # Generate jobs run in lanes beside the executor: their requests join the session's token
    # engine, whose batch changes at every step, so a generate job arriving while another is
    # generating starts at once instead of waiting for it. Every other kind runs alone: it waits for
    # the lanes to drain, so nothing else uses a group while its engine steps.
    def _start_lane(self, batch: list[Job]) -> None:
        with self._cond:
            while len(self._lanes) >= self.max_lanes:
                self._cond.wait(0.1)
            lane = threading.Thread(
                target=self._lane, args=(batch,), name="ster-queue-lane", daemon=True
            )
            self._lanes.add(lane)
            self.lanes_peak = max(self.lanes_peak, len(self._lanes))
        lane.start()

    def _lane(self, batch: list[Job]) -> None:
        try:
            self._attempt(batch)
        # as the executor: a bookkeeping failure fails the batch, not the queue
        except Exception as exc:
            print(f"ster job queue: lane: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            with self._cond:
                for job in batch:
                    if job.result is None:
                        job.result = protocol.make_result(
                            job.spec,
                            "failed",
                            error=f"{type(exc).__name__}: {exc}",
                            attempts=max(1, job.attempts),
                            exit_code=1,
                        )
                        job.state = "failed"
        finally:
            with self._cond:
                self._lanes.discard(threading.current_thread())
                self._cond.notify_all()

    def _wait_lanes(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._lanes and (deadline is None or time.monotonic() < deadline):
                self._cond.wait(0.1)

    def _attempt(self, batch: list[Job], warm_only: bool = False) -> bool:
        """Run the batch once (or only find its group); True when it got that far without
        failing."""
        with self._cond:
            if any(job.result is not None for job in batch):
                return False  # cancelled while its group was found
            for job in batch:
                if not warm_only:
                    job.attempts += 1
                    job.state = "running"
                    self._journal(job, self.journal.running, job.spec.id, job.attempts)
                    self._note(
                        job,
                        events.event(
                            f"running (attempt {job.attempts} of {self.max_retries + 1})"
                            + (
                                f", batched with {len(batch) - 1} other job(s)"
                                if len(batch) > 1
                                else ""
                            )
                        ),
                    )
            # no fsync here: a lost "running" record (power loss, not a killed process, which keeps
            # the flushed page) only undercounts attempts; the job is re-run either way
            self._cond.notify_all()

        def work(attempt: Attempt):
            def sink(event_: dict) -> None:
                with self._cond:
                    if attempt.abandoned:  # a thread past its deadline speaks for no job any more
                        return
                    for job in batch:
                        if job.result is None:
                            self._note(job, event_)
                    self._cond.notify_all()

            # the operation's progress lines, on its own thread, are the jobs' events
            stop = events.capture(sink)
            try:
                if warm_only:
                    # bad input is refused before any weight is read, as the operation itself would
                    # refuse it
                    ops.generate_inputs(batch[0].spec.request)
                    attempt.session = self.pool.get(batch[0].spec.request)
                    attempt.session.load()
                    return None
                with job_scope(batch[0].context):
                    return self._run(batch[0], attempt)
            finally:
                stop()

        started = time.monotonic()
        deadline = self._deadline(batch, started)
        attempt = Attempt(work, name=f"ster-job-{batch[0].spec.id}")
        with self._cond:
            self._running[attempt] = batch
        ended = attempt.start().wait(deadline)
        with self._cond:
            del self._running[attempt]
            # another attempt's timeout dropped the group it ran on: its jobs are queued again
            if attempt.abandoned:
                return False
            if not ended:
                attempt.abandon()
        if not ended:
            self._timed_out(batch, attempt, started, deadline)
            return False
        try:
            results = attempt.outcome()
        # every failure is the job's to report; the job queue keeps going
        except BaseException as exc:
            self._failed(batch, exc, counted=not warm_only)
            return False
        if warm_only:
            return True
        with self._cond:
            # a batch's jobs may have finished early
            unfinished = [job for job in batch if job.result is None]
            for job, (result, exit_code) in zip(batch, results):
                if job.result is None:
                    if job.context.cancelled:
                        self._note(
                            job,
                            events.event(
                                "the cancel came after the job's last step: it finished",
                                notice=True,
                            ),
                        )
                    self._finish(
                        job,
                        protocol.make_result(
                            job.spec, "done", result, attempts=job.attempts, exit_code=exit_code
                        ),
                        commit=False,
                    )
            self._commit(*unfinished)
            self._cond.notify_all()
        return True

    def _journal(self, job: Job, write, *args) -> bool:
        """Write one journal record; a write error becomes a notice on the job, never the executor's
        end."""
        try:
            write(*args)
            return True
        except OSError as exc:
            self._behind(exc, *([job] if job is not None else []))
            return False

    def _commit(self, *jobs: Job) -> None:
        try:
            self.journal.commit()
        except OSError as exc:
            self._behind(exc, *jobs)

    def _behind(self, exc: OSError, *jobs: Job) -> None:
        message = (
            f"{self.journal.refusal(exc)}; the journal is behind: a restart before it catches up "
            "may run this job again"
        )
        for job in jobs:
            self._note(job, events.event(message, notice=True, journal_behind=True))
        print(f"ster job queue: {message}", file=sys.stderr, flush=True)

    def _run(self, job: Job, attempt: Attempt) -> list[tuple[dict, int]]:
        request = job.spec.request
        operation = ops.OPERATIONS[type(request)]
        if operation.needs_session:
            session = attempt.session = self.pool.get(request)
            # an operation that does not go through the token engine has the ranks to itself: a
            # running engine (a server's) pauses between steps until it is done
            with contextlib.nullcontext() if operation.engine else session.exclusive():
                result = operation.run(session, request)
            self.pool.note_used(request)
        else:
            # it may bring Ray work of its own (a batch merge's tasks, tune's ranks): idle pooled
            # groups
            # must not hold the CPUs it waits for (it runs alone: no lane is using them)
            self.pool.make_room()
            result = operation.run(request)
        shown = ops.shown(request, result)
        return [(shown, ops.exit_code(request, shown))]

    # -- timeouts --------------------------------------------------------------------------------
    def _limit(self, job: Job) -> float | None:
        """How long this job may run: its spec's timeout_s, else the queue's job_timeout (None: no
        limit)."""
        own = job.spec.timeout_s
        return float(own) if own is not None else self.job_timeout

    def _deadline(self, batch: list[Job], started: float) -> float | None:
        """When the attempt is abandoned: at the first of its jobs' timeouts (monotonic), or
        never."""
        limits = [limit for limit in map(self._limit, batch) if limit is not None]
        return started + min(limits) if limits else None

    def _timed_out(
        self, batch: list[Job], attempt: Attempt, started: float, deadline: float
    ) -> None:
        """The attempt ran past its deadline and was abandoned: its thread may run on (Python cannot
        stop it; nothing it does reaches a job now), the group it was using is dropped
        (mid-operation, it cannot be trusted: the next job on the model gets a fresh session), the
        jobs whose own time ran out fail, and their batch-mates run again alone. A timed-out job is
        not retried: unlike a lost worker, a job that ran out of time would most likely run out of
        it again."""
        dropped = kept = False
        if attempt.session is not None:
            kept = self.pool.pinned(attempt.session)
            if not kept:
                self._abandon_sharers(attempt, ", ".join(job.spec.id for job in batch))
                dropped = self.pool.abandon(attempt.session)
                # whatever the abandoned thread loads on it again is closed when it ends
                attempt.after_abandoned(attempt.session.close)
        what = (
            "its worker group was dropped"
            if dropped
            else "the served model's worker group was kept"
            if kept
            else "its thread was left behind"
        )
        now = max(time.monotonic(), deadline)
        with self._cond:
            for job in batch:
                if job.result is not None:
                    continue
                limit = self._limit(job)
                if limit is not None and started + limit <= now:
                    job.attempts = max(job.attempts, 1)
                    error = (
                        f"job {job.spec.id} ran past its timeout of {limit:g} s; the job queue stopped "
                        f"waiting for it ({what}) and went on; give it a longer timeout_s if it needs the time"
                    )
                    self._note(job, events.event(error, notice=True, timed_out=True))
                    self._finish(
                        job,
                        protocol.make_result(
                            job.spec, "failed", error=error, attempts=job.attempts, exit_code=1
                        ),
                    )
                else:  # its own time is not out (another deadline cut the attempt): it runs again
                    self._requeue(job)
            self._cond.notify_all()

    def _abandon_sharers(self, late: Attempt, late_ids: str) -> None:
        """Other attempts on the group being dropped (generate lanes on its token engine, a group
        being warmed): closing it would end their requests early, as if answered. Abandoned too,
        their jobs run again, on a fresh group; they were not at fault."""
        with self._cond:
            for other, batch in list(self._running.items()):
                if other is late or other.abandoned or other.session is not late.session:
                    continue
                other.abandon()
                for job in batch:
                    if job.result is None:
                        self._note(
                            job,
                            events.event(
                                f"the worker group this job ran on was dropped (job(s) "
                                f"{late_ids} ran past a timeout); running it again on a "
                                "fresh one",
                                notice=True,
                            ),
                        )
                        self._requeue(job)
            self._cond.notify_all()

    def _failed(self, batch: list[Job], exc: BaseException, counted: bool) -> None:
        # jobs that finished before the failure stay done
        batch = [job for job in batch if job.result is None]
        if not batch:
            return
        if isinstance(exc, MemoryError):
            exc = OutOfMemory(
                f"this process ran out of memory: {exc or 'MemoryError'}; give it more memory or "
                "spread the model over more ranks (--tp / --ep)"
            )
        message = str(exc) if isinstance(exc, Refusal) else f"{type(exc).__name__}: {exc}"
        request = batch[0].spec.request
        if self.pool.holds(request) and not self.pool.alive(request):
            self.pool.drop(request, "dead")
        # a lost worker (workers/ray_group.py, workers/spawn.py) is retried on a restarted group; a
        # refusal a rank raised itself would only be repeated
        # (only once the job ran: a group that cannot even start fails its job)
        worker_died = isinstance(exc, WorkerLost) and counted
        with self._cond:
            for job in batch:
                if isinstance(exc, Cancelled):
                    self._finish(
                        job,
                        protocol.make_result(
                            job.spec,
                            "cancelled",
                            error=str(exc),
                            attempts=job.attempts,
                            exit_code=exc.exit_code,
                        ),
                    )
                    continue
                if not isinstance(exc, Refusal):
                    self._note(
                        job,
                        events.event(
                            "error", notice=True, traceback=traceback.format_exception(exc)[-3:]
                        ),
                    )
                if worker_died and job.attempts <= self.max_retries:
                    self._note(
                        job,
                        events.event(
                            f"a worker died: {message}; retrying on a restarted group", notice=True
                        ),
                    )
                    self._requeue(job)
                elif not counted and not worker_died:
                    job.attempts = max(job.attempts, 1)
                    self._finish(
                        job,
                        protocol.make_result(
                            job.spec, "failed", error=message, attempts=job.attempts, exit_code=2
                        ),
                    )
                else:
                    error = (
                        f"{message} (gave up after {job.attempts} attempts)"
                        if worker_died
                        else message
                    )
                    code = getattr(exc, "exit_code", 2) if isinstance(exc, Refusal) else 1
                    self._finish(
                        job,
                        protocol.make_result(
                            job.spec, "failed", error=error, attempts=job.attempts, exit_code=code
                        ),
                    )
            self._cond.notify_all()

    def _requeue(self, job: Job) -> None:
        job.state = "queued"
        heapq.heappush(self._queue, (-job.spec.priority, job.seq, job.spec.id))

    def _finish(self, job: Job, record: dict, commit: bool = True) -> None:
        # the waiting caller gets the result even when the disk cannot take it (the journal keeps
        # the record in memory and writes it first once it can)
        self._journal(job, self.journal.finished, job.spec.id, record)
        if commit:
            self._commit(job)
        job.result = record
        job.state = record["status"]
        self._note(job, events.event(f"{record['status']}", status=record["status"]))
        self._forget_past(job)
        self._cond.notify_all()

    def _forget_past(self, job: Job) -> None:
        """Keep at most keep_finished finished jobs in memory, dropping the oldest (the journal has
        them)."""
        self._finished.append(job.spec.id)
        while len(self._finished) > self.keep_finished:
            old = self.jobs.get(self._finished.popleft())
            if old is not None and old.result is not None:
                del self.jobs[old.spec.id]
                self.forgotten += 1


def running() -> JobQueue | None:
    """The job queue started in this process, if any (an Engine's): a command line joins it."""
    return _ACTIVE[0] if _ACTIVE else None


def _same(a, b) -> bool:
    return a.kind == b.kind and a.fields == b.fields and a.timeout_s == b.timeout_s


def raw_spec(job_id: str, spec: dict) -> RawSpec:
    priority = spec.get("priority", 0)
    return RawSpec(
        job_id, str(spec.get("kind", "?")), priority if isinstance(priority, int) else 0, spec
    )
