"""Ranks in processes spawned by torch.multiprocessing: the same Rank as the Ray actors,
driven over pipes. For one machine without Ray (tests, benchmarks); the CLI uses Ray.
"""

from __future__ import annotations

import time
import traceback

import torch.multiprocessing as mp

from ster_dist.errors import Refusal, WorkerLost
from ster_dist.workers.extension import OnRanks, describe
from ster_dist.workers.rank import Rank, free_port
from ster_dist.workers.worker_group import WorkerGroup


def _serve(rank: int, world: int, threads: int | None, conn, ep: int = 1, pp: int = 1) -> None:
    worker = Rank(rank, world, threads, ep, pp)
    while True:
        method, args = conn.recv()
        if method is None:
            worker.close()
            conn.close()
            return
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Refusal as refusal:
            conn.send(("refusal", str(refusal)))
        except BaseException as exc:  # sent back whole: the driver decides how to show it
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class SpawnGroup(WorkerGroup):
    def __init__(
        self,
        world: int,
        threads: int | None = 1,
        timeout_s: float = 600.0,
        ep: int = 1,
        host: str = "127.0.0.1",
        pp: int = 1,
    ):
        """world ranks: pp pipeline stages of world / (ep x pp) tensor-parallel ranks times ep
        expert-parallel ranks, meeting at host."""
        if ep < 1 or pp < 1 or world % (ep * pp):
            raise Refusal(
                f"{world} ranks do not split into --pp {pp} stages of --ep {ep} expert-parallel groups"
            )
        ctx = mp.get_context("spawn")
        self.world, self.timeout_s = world, timeout_s
        self.lead = (pp - 1) * (world // pp)  # the rank whose answer is the group's (Rank.lead)
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(rank, world, threads, child, ep, pp), daemon=True
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.call("join", host, free_port(host), "gloo")

    def on(self, cls: type) -> OnRanks:
        return OnRanks(self, cls)

    def call(self, method: str, *args) -> list:
        return self.collect(self.submit(method, *args))

    def submit(self, method: str, *args) -> str:
        """Send a call to every rank without waiting (its handle for collect). Ranks answer calls in
        the order they were sent: collect them in that order, and call nothing else in between."""
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args))
            except (OSError, BrokenPipeError):
                self.close()
                raise WorkerLost(
                    f"rank {rank} died before {describe(method, args)}; the group was shut down"
                ) from None
        # the errors below name an extension's method, not call_extension
        return describe(method, args)

    def collect(self, method: str) -> list:
        """Every rank's answer to the oldest call submitted and not yet collected."""
        results = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(self.timeout_s):
                self.close()
                raise WorkerLost(
                    f"rank {rank} did not answer {method} within {self.timeout_s:.0f} s; "
                    "the group was shut down"
                )
            try:
                status, value = conn.recv()
            except EOFError:
                self.close()
                raise self._lost(rank, method) from None
            if status != "ok":
                first = value.splitlines()[0]
                # a rank's collective fails when a peer dies: blame the dead one, not the messenger
                dead = self._dead_rank() if status == "error" else None
                self.close()
                if dead is not None:
                    raise self._lost(dead, method)
                raise Refusal(
                    first if status == "refusal" else f"rank {rank} failed during {method}: {first}"
                )
            results.append(value)
        return results

    def _dead_rank(self, grace_s: float = 2.0) -> int | None:
        deadline = time.monotonic() + grace_s
        while True:
            dead = [rank for rank, proc in enumerate(self.procs) if not proc.is_alive()]
            if dead or time.monotonic() > deadline:
                return dead[0] if dead else None
            time.sleep(0.05)

    def _lost(self, rank: int, method: str) -> WorkerLost:
        self.close()
        return WorkerLost(f"rank {rank} died during {method}; the group was shut down")

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send((None, ()))
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.conns, self.procs = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
