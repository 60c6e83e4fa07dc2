"""WorkerGroup: what every group of ranks offers the driver, whoever runs the ranks.

Three classes implement it: LocalGroup (one Rank in this process, workers/group.py), SpawnGroup
(processes over pipes, workers/spawn.py) and RayGroup (actors, workers/ray_group.py). A caller holds
a WorkerGroup and never asks which one it has. `call` runs one of Rank's own methods on every rank
and returns their answers in rank order; `submit` and `collect` are the same call in two halves, so
several can be in flight (pipeline stages then work on different ones); `on(cls)` reaches a rank
extension (workers/extension.py); `lead` is the index of the rank whose answer is the group's.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ster_dist.workers.extension import OnRanks


@runtime_checkable
class WorkerGroup(Protocol):
    lead: int  # the rank whose answer is the group's (Rank.lead): the last pipeline stage's first

    def call(self, method: str, *args) -> list:
        """Every rank's answer to Rank.`method`(*args), in rank order."""
        ...

    def submit(self, method: str, *args) -> Any:
        """Send the call to every rank without waiting; the handle `collect` takes. Calls are
        answered in the order they were sent."""
        ...

    def collect(self, handle: Any) -> list:
        """Every rank's answer to the oldest submitted call not yet collected."""
        ...

    def on(self, cls: type) -> OnRanks:
        """Rank extension `cls`'s methods on every rank."""
        ...

    def close(self) -> None:
        """Close every rank (its extensions first) and release the processes or actors."""
        ...
