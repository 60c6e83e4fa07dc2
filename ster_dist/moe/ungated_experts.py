"""This rank's experts without a gate (Nemotron-H's): act(up x) then down, stacked as up [local experts,
intermediate share, hidden] and down [local experts, hidden, intermediate share].

Split as the gated experts are (moe/experts.py): contiguous expert blocks over the expert-parallel group,
each expert's up by output rows and down by input columns over the tensor-parallel group, so the output is
a partial sum the MoE layer all-reduces once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import MoEConfig
from ster_dist.layers.activation import activation
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ShardedModule


class UngatedExperts(ShardedModule):
    def __init__(self, moe: MoEConfig, hidden: int, hidden_act: str, ctx: ParallelCtx):
        super().__init__()
        num, inner = moe.num_experts, moe.intermediate_size
        self.first, last = ctx.experts(num)
        self.local = last - self.first
        rows = (ctx.split(inner),)
        block = (self.first, last)
        self._param("up", Shard((num, inner, hidden), 1, rows, experts=block))
        self._param("down", Shard((num, hidden, inner), 2, rows, experts=block))
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each row of x [rows, hidden] through its expert (local_ids [rows], 0-based on this rank)."""
        out = x.new_empty((x.shape[0], self.down.shape[1]))
        if x.shape[0] == 0:
            return out
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=self.local).tolist()
        grouped = x[order]
        results = torch.empty_like(out)
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = grouped[start:start + count]
                results[start:start + count] = F.linear(self.act(F.linear(rows, self.up[e])), self.down[e])
                start += count
        out[order] = results
        return out
