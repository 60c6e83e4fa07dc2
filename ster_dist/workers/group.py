"""Driving a model across ranks: load once per rank, then logits / parity / rank extensions (the
token engine's ModelRunner among them).

`open_group` picks the group: a single in-process Rank for one rank (no Ray, no
process group: the embedded default), Ray actors (or spawned processes) for tp x ep x pp ranks.
Every group is a WorkerGroup (workers/worker_group.py): `call`, `submit` / `collect`, `on(cls)`,
`close` and `lead`.
"""

from __future__ import annotations

from ster_dist.checkpoint import Checkpoint
from ster_dist.workers.extension import OnRanks
from ster_dist.workers.rank import Rank
from ster_dist.workers.worker_group import WorkerGroup


class LocalGroup(WorkerGroup):
    """One rank in this process: the same calls as RayGroup and SpawnGroup, no communication."""

    lead = 0  # the rank whose answer is the group's (Rank.lead)

    def __init__(self):
        self.rank = Rank(0, 1)

    @classmethod
    def holding(cls, loaded) -> "LocalGroup":
        """A group around a model this process has loaded already (tests, benchmarks)."""
        group = cls()
        group.rank.loaded = loaded
        return group

    def call(self, method: str, *args) -> list:
        return [getattr(self.rank, method)(*args)]

    def submit(self, method: str, *args) -> list:
        """As the other groups' submit; one rank in this process has answered by the time it
        returns."""
        return self.call(method, *args)

    def collect(self, handle: list) -> list:
        return handle

    def on(self, cls: type) -> OnRanks:
        return OnRanks(self, cls)

    def close(self) -> None:
        self.rank.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_group(
    tp: int,
    device: str = "cpu",
    address: str | None = None,
    launcher: str = "ray",
    ep: int = 1,
    pp: int = 1,
) -> WorkerGroup:
    """tp x ep x pp ranks: tensor-parallel groups of tp, expert-parallel groups of ep, pp pipeline
    stages."""
    world = tp * ep * pp
    if world == 1 and address is None:
        return LocalGroup()
    if launcher == "spawn":
        from ster_dist.workers.spawn import SpawnGroup

        return SpawnGroup(world, ep=ep, pp=pp)
    from ster_dist.workers.ray_group import RayGroup

    return RayGroup(world, device, address, ep=ep, pp=pp)


def load_on(
    group: WorkerGroup,
    checkpoint: Checkpoint,
    precision: str,
    device: str,
    weights: str = "dequantize",
) -> list[dict]:
    """Every rank loads its shard of the checkpoint the driver resolved (once)."""
    return group.call("load", checkpoint, precision, device, weights)
