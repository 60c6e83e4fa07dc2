"""This rank's experts, stacked: gate and up [local experts, intermediate share, hidden], down
[local experts, hidden, intermediate share], and GPT-OSS's biases.

Experts are split in contiguous blocks over the expert-parallel group; within
each expert the matrices are split over the tensor-parallel group like a dense
feed-forward (gate/up by output rows, down by input columns), so the output is
a partial sum the MoE layer all-reduces once, together with the shared experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import MoEConfig
from ster_dist.layers.activation import activation
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ShardedModule


class Experts(ShardedModule):
    def __init__(self, moe: MoEConfig, hidden: int, hidden_act: str, ctx: ParallelCtx):
        super().__init__()
        num, inner = moe.num_experts, moe.intermediate_size
        self.first, last = ctx.experts(num)
        self.local = last - self.first
        rows = (ctx.split(inner),)
        block = (self.first, last)
        self._param("gate", Shard((num, inner, hidden), 1, rows, experts=block))
        self._param("up", Shard((num, inner, hidden), 1, rows, experts=block))
        self._param("down", Shard((num, hidden, inner), 2, rows, experts=block))
        if moe.expert_bias:
            self._param("gate_bias", Shard((num, inner), 1, rows, experts=block))
            self._param("up_bias", Shard((num, inner), 1, rows, experts=block))
            self._param("down_bias", Shard((num, hidden), experts=block))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        self.clamped = moe.activation == "clamped_swiglu"
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha
        self.act = activation(hidden_act)
        self.add_down_bias = ctx.tp_rank == 0  # the partial sums are all-reduced: add the bias once

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
                results[start:start + count] = self._expert(e, grouped[start:start + count])
                start += count
        out[order] = results
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate = F.linear(x, self.gate[e], None if self.gate_bias is None else self.gate_bias[e])
        up = F.linear(x, self.up[e], None if self.up_bias is None else self.up_bias[e])
        if self.clamped:  # GPT-OSS: (clamp(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            gate = gate.clamp(max=self.limit)
            h = (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))
        else:
            h = self.act(gate) * up
        bias = self.down_bias[e] if self.down_bias is not None and self.add_down_bias else None
        return F.linear(h, self.down[e], bias)
