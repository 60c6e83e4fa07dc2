"""The job queue's worker groups: one session (a loaded model) per (model, revision, precision,
device, tp, ep, weights), reused by every later job with that key, released after an idle timeout
(or sooner, when idle, for an operation whose own Ray work needs the CPUs it reserves), restarted
when one of its workers has died, and dropped when a job on it ran past its timeout.

A session is handed out unloaded: its operation checks its inputs first and loads the model on
first use, so a refused input never costs a load. Without a cluster address a one-rank group runs
in this process and larger ones on an embedded local Ray cluster the pool starts (and stops on
close); with one, every group is Ray actors on that cluster, so a model never lives in the job
queue's own process there.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field

from ster_dist.events import progress
from ster_dist.schema.common import Runtime
from ster_dist.session import Session


@dataclass
class Pooled:
    session: Session
    key: tuple
    started: float
    last_used: float
    workers: list = field(default_factory=list)
    jobs: int = 0
    counted: bool = False  # its load counted in `starts`
    pinned: bool = False  # a server's model: never released for idleness nor evicted


class GroupPool:
    def __init__(self, address: str | None = None, idle_s: float = 300.0, max_groups: int = 4):
        self.address = address
        self.idle_s = idle_s
        self.max_groups = max(1, max_groups)
        self.groups: dict[tuple, Pooled] = {}
        self.starts = 0
        self.releases = 0
        # ("start" | "idle" | "dead" | "evict" | "cpus" | "timeout" | "close", key)
        self.history: list[tuple[str, tuple]] = []
        self._started_ray = False
        self._lock = threading.RLock()

    # -- what operations are given -----------------------------------------------------------
    def get(self, runtime: Runtime) -> Session:
        """The session for this runtime (unloaded when new: it loads on first use)."""
        key = runtime.group_key()
        with self._lock:
            pooled = self.groups.get(key)
            if pooled is not None and pooled.session.loaded and not _alive(pooled.session.group):
                self._drop(key, "dead")
                pooled = None
            if pooled is None:
                pooled = self._start(key, runtime)
            pooled.last_used = time.monotonic()
            pooled.jobs += 1
            return pooled.session

    def pin(self, runtime: Runtime) -> Session:
        """The session for this runtime, kept loaded until the pool closes (`ster serve`'s
        model)."""
        session = self.get(runtime)
        with self._lock:
            self.groups[runtime.group_key()].pinned = True
        return session

    def note_used(self, runtime: Runtime) -> None:
        """After a job ran on a session: its group is not idle from here."""
        with self._lock:
            pooled = self.groups.get(runtime.group_key())
            if pooled is not None:
                pooled.last_used = time.monotonic()

    def _loaded(self, key: tuple, session: Session) -> None:
        """A session's ranks hold the model: count the start and note where its ranks run (for
        stats, and for an operator who needs the processes)."""
        workers = session.group.call("whereabouts")
        with self._lock:
            pooled = self.groups.get(key)
            if pooled is None or pooled.session is not session:
                return
            pooled.workers, pooled.counted = workers, True
            pooled.last_used = time.monotonic()
            self.starts += 1
            self.history.append(("start", key))

    def prepare(self, world: int) -> None:
        """Connect to (or start) Ray now, on the calling thread, when groups of `world` ranks will
        need it: Ray installs its signal handlers only from the main thread, and a cluster it
        started from the executor thread outlives a clean shutdown from another."""
        if self.address is not None or world > 1:
            with self._lock:
                self._ensure_ray()

    # -- what the job queue calls ------------------------------------------------------------
    def holds(self, runtime: Runtime) -> bool:
        with self._lock:
            pooled = self.groups.get(_key(runtime))
            return pooled is not None and pooled.session.loaded

    def alive(self, runtime: Runtime) -> bool:
        with self._lock:
            pooled = self.groups.get(_key(runtime))
            return pooled is not None and pooled.session.loaded and _alive(pooled.session.group)

    def drop(self, runtime: Runtime, why: str = "dead") -> None:
        with self._lock:
            if _key(runtime) in self.groups:
                self._drop(_key(runtime), why)

    def pinned(self, session: Session) -> bool:
        with self._lock:
            return any(p.session is session and p.pinned for p in self.groups.values())

    def abandon(self, session: Session) -> bool:
        """Drop the group a job ran past its timeout on: it was mid-operation and cannot be trusted,
        and the next job on its model gets a fresh session. Closed on a thread of its own, never
        waited
        for:
        closing may block on what is stuck (a token engine paused by the stuck operation, a rank
        that answers nothing). False when the session is pinned (a server's model stays: the server
        owns it)."""
        with self._lock:
            pooled = next((p for p in self.groups.values() if p.session is session), None)
            if pooled is not None and pooled.pinned:
                return False
            if pooled is not None:
                del self.groups[pooled.key]
                if pooled.counted:
                    self.releases += 1
                    self.history.append(("timeout", pooled.key))
        group = session.group if session.loaded else None
        if group is not None and hasattr(group, "healthy"):
            # a Ray group then kills its ranks at once instead of asking them to close
            group.healthy = False
        threading.Thread(
            target=_close_quietly, args=(session,), name="ster-pool-drop", daemon=True
        ).start()
        if pooled is not None and pooled.counted:
            progress(
                f"released the worker group for {pooled.key[0]} (tp {pooled.key[4]}): a job ran past its timeout"
            )
        return True

    def release_idle(self, now: float | None = None) -> list[tuple]:
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [
                k
                for k, p in self.groups.items()
                if now - p.last_used >= self.idle_s and not p.pinned
            ]
            for key in idle:
                self._drop(key, "idle")
            return idle

    def make_room(self, cpus: float = 1.0) -> list[tuple]:
        """Release idle groups (least recently used first; never a pinned one) until the Ray cluster
        has
        `cpus` CPUs that no group reserves: the job queue calls it, with no job on the pool's
        groups, before an operation that brings Ray work of its own (a batch merge's shard tasks
        each need a CPU), which would otherwise wait for the idle timeout. Each group leaves a CPU
        unreserved (workers/ray_group.py cpus_per_rank), so this only releases where several groups
        fill a small cluster. The keys released."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return []  # no cluster: nothing of this pool's holds a CPU another operation could need
        free = ray.available_resources().get("CPU", 0.0)
        released = []
        with self._lock:
            for pooled in sorted(self.groups.values(), key=lambda p: p.last_used):
                held = (
                    getattr(pooled.session.group, "reserved_cpus", 0.0)
                    if pooled.session.loaded
                    else 0.0
                )
                if free >= cpus:
                    break
                if pooled.pinned or held <= 0:
                    continue
                self._drop(pooled.key, "cpus")
                free += held  # counted here: Ray's own view of what is free lags the release
                released.append(pooled.key)
        return released

    def describe(self) -> list[dict]:
        """A snapshot of the loaded groups, without the lock: callers ask while a group may be
        loading."""
        now = time.monotonic()
        return [
            {
                "model": k[0],
                "revision": k[1],
                "precision": k[2],
                "device": k[3],
                "tp": k[4],
                "ep": k[5],
                "weights": k[6],
                "pp": k[7],
                "jobs": p.jobs,
                "idle_s": round(now - p.last_used, 3),
                "workers": p.workers,
            }
            for k, p in list(self.groups.items())
            if p.counted
        ]

    def close(self) -> None:
        with self._lock:
            for key in list(self.groups):
                self._drop(key, "close")
            if self._started_ray:
                import ray

                if ray.is_initialized():
                    ray.shutdown()
                self._started_ray = False

    # -- inside ------------------------------------------------------------------------------
    def _start(self, key: tuple, runtime: Runtime) -> Pooled:
        while len(self.groups) >= self.max_groups and any(
            not p.pinned for p in self.groups.values()
        ):
            oldest = min(
                (p for p in self.groups.values() if not p.pinned), key=lambda p: p.last_used
            )
            self._drop(oldest.key, "evict")
        if self.address is not None or runtime.tp * runtime.ep > 1:
            self._ensure_ray()
        session = Session(
            runtime, address=self.address, on_load=lambda loaded: self._loaded(key, loaded)
        )
        now = time.monotonic()
        pooled = Pooled(session, key, now, now)
        self.groups[key] = pooled
        return pooled

    def _drop(self, key: tuple, why: str) -> None:
        pooled = self.groups.pop(key)
        try:
            pooled.session.close()
        except Exception:  # a dead group may fail to close cleanly; it is gone either way
            pass
        if not pooled.counted:
            return  # never loaded: nothing was started, nothing is released
        self.releases += 1
        self.history.append((why, key))
        if why in ("idle", "dead", "evict"):
            progress(f"released the worker group for {key[0]} (tp {key[4]}): {why}")
        elif why == "cpus":
            progress(
                f"released the idle worker group for {key[0]} (tp {key[4]}): the next job needs its CPUs"
            )

    def _ensure_ray(self) -> None:
        from ster_dist.workers.ray_group import start_ray

        if start_ray(self.address):
            self._started_ray = True


def _close_quietly(session: Session) -> None:
    try:
        session.close()
    # a group dropped mid-operation may fail to close cleanly; it is gone either way
    except Exception:
        pass


def _key(runtime: Runtime) -> tuple:
    return runtime.group_key() if hasattr(runtime, "group_key") else ()


def _alive(group) -> bool:
    """Whether every worker of a group still answers (a failed call shuts a Ray or spawned
    group)."""
    if hasattr(group, "actors"):
        if not group.actors:
            return False
        import ray

        refs = [actor.__ray_ready__.remote() for actor in group.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=30)
        if len(ready) != len(refs):
            return False
        try:
            ray.get(ready)
        except Exception:
            return False
        return True
    if hasattr(group, "procs"):
        return bool(group.procs) and all(p.is_alive() for p in group.procs)
    return True
