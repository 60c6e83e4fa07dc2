"""RunnerClient: the driver's typed calls to the engine's rank side (engine/runner.py's
ModelRunner).

The only code that names ModelRunner's methods: the loop (engine/loop.py), a benchmark or a test
call these, never `group.on(ModelRunner).<name>` or a method name of their own. Each call runs on
every rank of the group, in rank order; each rank's answer comes back as a list, except a step's
result (the lead rank's sampled tokens) and the graphs warmed (rank 0's count).
"""

from __future__ import annotations

from typing import Any

from ster_dist.engine.runner import ModelRunner
from ster_dist.engine.work import StepResult, StepWork
from ster_dist.workers.worker_group import WorkerGroup


class RunnerClient:
    def __init__(self, group: WorkerGroup):
        self.group = group

    def _every(self, method: str, *args) -> list:
        return self.group.call("call_extension", ModelRunner, method, *args)

    # -- starting and stopping the cache -----------------------------------------------------------
    def select_kernels(self, choice: str | None) -> list[str]:
        """Each rank's kernels (kernels/select.py), refused where they cannot run there."""
        return self._every("select_kernels", choice)

    def pack_weights(self, mode: str) -> list[int]:
        """Each rank's bytes of projection weights packed for the CPU's products
        (parallel/packed.py)."""
        return self._every("pack_weights", mode)

    def capacity(
        self, block_size: int, memory: int | None, fraction: float, cap: int | None = None
    ) -> list[dict]:
        """Each rank's cache budget and what a block and a recurrent state cost there."""
        return self._every("capacity", block_size, memory, fraction, cap)

    def draft_block_bytes(self, block_size: int) -> list[int]:
        """Each rank's bytes of one block of the MTP layer's own cache."""
        return self._every("draft_block_bytes", block_size)

    def start(
        self,
        num_blocks: int,
        block_size: int,
        state_slots: int,
        speculative: bool,
        compile_after: int | None,
    ) -> None:
        self._every("start", num_blocks, block_size, state_slots, speculative, compile_after)

    def warm(self, max_tokens: int) -> int | None:
        """The compiled graphs rank 0 made for every step size up to `max_tokens` (None: steps stay
        eager)."""
        return self._every("warm", max_tokens)[0]

    def stop(self) -> None:
        """Every rank drops its cache and registrations; the model stays loaded."""
        self._every("stop")

    # -- modifiers ---------------------------------------------------------------------------------
    def register_vector(self, key: str, vectors) -> None:
        self._every("register_vector", key, vectors)

    def register_adapter(self, name: str, sites: list[dict]) -> None:
        self._every("register_adapter", name, sites)

    def replace_adapter(self, name: str, sites: list[dict]) -> None:
        self._every("replace_adapter", name, sites)

    # -- steps -------------------------------------------------------------------------------------
    def submit_step(self, work: StepWork) -> Any:
        """Send one step to every rank without waiting; the handle for `collect_step`."""
        return self.group.submit("call_extension", ModelRunner, "step", work)

    def collect_step(self, handle: Any) -> StepResult:
        """The lead rank's result of the oldest step submitted and not yet collected."""
        return self.group.collect(handle)[self.group.lead]

    def step(self, work: StepWork) -> StepResult:
        return self.collect_step(self.submit_step(work))

    def timings(self) -> list[dict]:
        """Each rank's seconds in steps, and of those waiting on the previous pipeline stage."""
        return self._every("timings")
