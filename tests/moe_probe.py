"""Rank extensions for tests and bench/moe.py: DispatchProbe counts what the expert-parallel
dispatch moves; CompiledSwitch turns a rank's compiled steps on and off.

The counters live here, not in the model: on first use on a rank, DispatchProbe swaps the
`dispatch` name moe/layer.py calls for a wrapper that records each call, and puts the original
back when the rank closes. A rank is one process on Ray and under SpawnGroup, so each rank counts
only its own dispatches; in a LocalGroup the swap covers every model in the driver's process. While
it counts, every step dispatches: the small steps that skip the dispatch (MoE.replicated) take it
again after `replicate(True)`.
"""

from __future__ import annotations

from ster_dist.moe import layer
from ster_dist.workers.extension import RankExtension

_ZERO = {"tokens": 0, "pairs_sent_away": 0, "forwards": 0}


class DispatchProbe(RankExtension):
    def __init__(self, rank):
        super().__init__(rank)
        # rows this rank's experts took, per dispatch since the last reset
        self.received: list[int] = []
        self.totals = dict(_ZERO)
        self._original = layer.dispatch
        layer.dispatch = self._dispatch
        self._replicated_bytes = layer.REPLICATED_BYTES
        self.replicate(False)  # counting the dispatch: every step dispatches until replicate(True)

    def _dispatch(self, x, ids, num_experts, ctx, pairs=False):
        rows, local_ids, handle = self._original(x, ids, num_experts, ctx, pairs=pairs)
        self.received.append(rows.shape[0])
        # this rank's share of the tokens (x has a row per pair under pairs)
        self.totals["tokens"] += ids.shape[0]
        self.totals["pairs_sent_away"] += sum(handle.sent) - handle.sent[ctx.ep_rank]
        self.totals["forwards"] += 1
        return rows, local_ids, handle

    def replicate(self, on: bool) -> None:
        """Let small steps skip the dispatch (MoE.replicated) again, or not."""
        layer.REPLICATED_BYTES = self._replicated_bytes if on else 0

    def reset(self) -> None:
        """Start counting afresh (also installs the probe, when this is its first use on the
        rank)."""
        self.received.clear()
        self.totals = dict(_ZERO)

    def received_rows(self) -> list[int]:
        """Rows this rank's experts took per dispatch since the reset: per MoE layer, after one
        forward."""
        return list(self.received)

    def traffic(self, reset: bool = False) -> dict:
        """This rank's dispatch counts since the reset, summed over its MoE layers: tokens it
        dispatched, (token, expert) pairs it sent to other ranks, layer forwards; and how many MoE
        layers it holds."""
        moe_layers = sum(isinstance(block.mlp, layer.MoE) for block in self.model.layers)
        out = {**self.totals, "moe_layers": moe_layers}
        if reset:
            self.reset()
        return out

    def close(self) -> None:
        if layer.dispatch == self._dispatch:  # not replaced again since: put the original back
            layer.dispatch = self._original
        self.replicate(True)


class CompiledSwitch(RankExtension):
    """A rank's compiled steps on or off (bench/moe.py's ster_ep2 against ster_ep2_compiled, run by
    run): compiled on first use, the graphs kept while off."""

    def __init__(self, rank):
        super().__init__(rank)
        self.layers = None

    def use(self, on: bool) -> str | None:
        """Compiled steps from now on (`on`) or eager ones; why not, where the model cannot
        compile."""
        model = self.model
        if on and self.layers is None:
            if (reason := model.compile_layers()) is not None:
                return reason
            self.layers = model.compiled
        model.compiled = self.layers if on else None
        return None
