"""Looped models: layers that run stored layers' weights again (ModelConfig.loop_layers,
loop_schedule).

A looped model's layers are every pass's, so each has its own cache slots and its own hook site
(capture and steering), while its weights are a stored layer's, read once and held once
(`tie_parameters`). Nanbeige's passes run its one stack again on the hidden state, the first pass's
layers holding the weights. HRM-Text's run two stacks (low and high) on two states: a pass reads the
states summed and its output replaces one of them. Its stacks are held apart from the layers
(`Decoder.stacks`, `stacks.{stack}.{j}`), so the name map reads them whatever the schedule. The plan
below is that schedule as per-layer data the decoder walks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ster_dist.config import ModelConfig


@dataclass(frozen=True)
class LoopPlan:
    # per layer, the (stack, index) of the held stored layer whose weights it runs; empty: no held
    # stacks
    held: tuple[tuple[int, int], ...] = ()
    # per layer i past the first pass of a one-stack loop (Nanbeige), the earlier layer whose
    # weights it runs
    tied: dict[int, int] = field(default_factory=dict)
    # a pass's first layer -> states summed in
    reads: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # a pass's last layer -> the state it replaces
    writes: dict[int, int] = field(default_factory=dict)
    # layers after which the final norm closes a pass that is not the last
    ends: frozenset[int] = frozenset()
    init: bool = False  # state 1 starts as the decoder's loop_init vector

    @property
    def stacks(self) -> int:
        return 1 + max(stack for stack, _ in self.held) if self.held else 0

    def first_layer(self, stack: int, index: int) -> int:
        """The first layer running held layer (stack, index): the per-layer data its holder is built
        with."""
        return self.held.index((stack, index))


def loop_plan(cfg: ModelConfig) -> LoopPlan:
    n = cfg.loop_layers
    if not n:
        return LoopPlan()
    ends = frozenset(range(n - 1, cfg.num_layers - 1, n)) if cfg.loop_pass_norm else frozenset()
    if not cfg.loop_schedule:
        return LoopPlan(tied={i: i % n for i in range(n, cfg.num_layers)}, ends=ends)
    held = tuple((stack, j) for stack, _, _ in cfg.loop_schedule for j in range(n))
    reads = {p * n: reads for p, (_, _, reads) in enumerate(cfg.loop_schedule)}
    writes = {p * n + n - 1: state for p, (_, state, _) in enumerate(cfg.loop_schedule)}
    init = any(1 in r for r in reads.values())
    return LoopPlan(held=held, reads=reads, writes=writes, ends=ends, init=init)
