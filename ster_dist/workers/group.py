"""Driving a model across ranks: load once per rank, then generate / logits / parity.

`open_group` picks the group: a single in-process Rank for one rank (no Ray, no
process group: the embedded default), Ray actors (or spawned processes) for tp x ep ranks.
Every group has `call(method, *args)` for Rank's own methods and `on(cls)` for a rank
extension's (workers/extension.py).
"""

from __future__ import annotations

from ster_dist.checkpoint import Checkpoint
from ster_dist.workers.extension import OnRanks
from ster_dist.workers.rank import Rank


class LocalGroup:
    """One rank in this process: the same calls as RayGroup and SpawnGroup, no communication."""

    def __init__(self):
        self.rank = Rank(0, 1)

    def call(self, method: str, *args) -> list:
        return [getattr(self.rank, method)(*args)]

    def on(self, cls: type) -> OnRanks:
        return OnRanks(self, cls)

    def close(self) -> None:
        self.rank.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_group(tp: int, device: str = "cpu", address: str | None = None, launcher: str = "ray", ep: int = 1):
    """tp x ep ranks: tensor-parallel groups of tp, expert-parallel groups of ep."""
    world = tp * ep
    if world == 1 and address is None:
        return LocalGroup()
    if launcher == "spawn":
        from ster_dist.workers.spawn import SpawnGroup

        return SpawnGroup(world, ep=ep)
    from ster_dist.workers.ray_group import RayGroup

    return RayGroup(world, device, address, ep=ep)


def load_on(group, checkpoint: Checkpoint, precision: str, device: str, weights: str = "dequantize") -> list[dict]:
    """Every rank loads its shard of the checkpoint the driver resolved (once)."""
    return group.call("load", checkpoint, precision, device, weights)
