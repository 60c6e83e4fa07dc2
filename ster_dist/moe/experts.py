"""This rank's experts, stacked: gate and up [local experts, intermediate share, hidden], down
[local experts, hidden, intermediate share], and GPT-OSS's biases; and the one grouped computation
that runs every row through its expert.

Experts are split in contiguous blocks over the expert-parallel group; within
each expert the matrices are split over the tensor-parallel group like a dense
feed-forward (gate/up by output rows, down by input columns), so the output is
a partial sum the MoE layer all-reduces once, together with the shared experts.

Rows are sorted by expert and each projection is one `grouped_mm` over the
stacked weights with the running row counts as offsets: no per-expert Python
loop and no host sync (the offsets stay a tensor). The size rule (measured with
bench/moe.py's loop/grouped/gathered A/B on this CPU build):
- grouped_mm wherever it accepts the layout, at every row count: decode's
  handful of rows and prefill's hundreds alike. It reads each selected
  expert's weights once, as the per-expert loop did, minus the loop's per-expert
  Python overhead and the bincount(...).tolist() sync.
- Gathering the selected experts' weights row by row into one bmm (the other
  candidate for rows << experts) is never taken: the gather copies every
  selected matrix, so each decode step moves its expert weights three times
  (read, write, read again) and ran 3-5x slower than the loop at 1-16 rows.
- grouped_mm refuses strides that are not multiples of 16 bytes (an odd
  hidden or intermediate share: tiny test models, uneven TP shares); those
  layouts keep the per-expert loop, which runs any shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ster_dist.config import MoEConfig
from ster_dist.layers.activation import activation
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ShardedModule

# rows [m, in] and a stacked weight [experts, out, in] -> each row times its expert's weight, [m, out]
Project = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GROUPED_ALIGN = 16  # bytes: grouped_mm's rule for every non-unit stride of its operands and output


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
        if x.shape[0] == 0:
            return x.new_empty((0, self.down.shape[1]))
        order = torch.argsort(local_ids, stable=True)
        ids = local_ids[order]
        counts = torch.bincount(local_ids, minlength=self.local)
        project = self._grouped(counts) if self.groupable(x) else self._per_expert(counts)
        y = self._mlp(x[order], ids, project)
        out = torch.empty_like(y)
        out[order] = y
        return out

    def groupable(self, x: torch.Tensor) -> bool:
        """Whether grouped_mm takes this layout: its devices and dtypes, and every non-unit stride of
        its operands and outputs a multiple of 16 bytes (the rows and outputs are contiguous [rows,
        hidden or inner share]; each weight is read transposed, so its two outer strides count)."""
        if x.device.type not in ("cpu", "cuda"):
            return False
        if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
            return False  # grouped_mm's CUDA kernels start at SM80
        weights = (self.gate, self.up, self.down)
        if x.dtype not in GROUPED_DTYPES or any(w.dtype != x.dtype or w.stride(-1) != 1 for w in weights):
            return False
        strides = [self.gate.shape[1], self.down.shape[1], *(s for w in weights for s in w.stride()[:2])]
        return all(s * x.element_size() % GROUPED_ALIGN == 0 for s in strides)

    def _mlp(self, x: torch.Tensor, ids: torch.Tensor, project: Project) -> torch.Tensor:
        """The experts' feed-forward on rows sorted by expert (ids [rows], sorted)."""
        gate, up = project(x, self.gate), project(x, self.up)
        if self.gate_bias is not None:
            gate, up = gate + self.gate_bias[ids], up + self.up_bias[ids]
        if self.clamped:  # GPT-OSS: (clamp(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            gate = gate.clamp(max=self.limit)
            h = (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))
        else:
            h = self.act(gate) * up
        y = project(h, self.down)
        if self.down_bias is not None and self.add_down_bias:
            y = y + self.down_bias[ids]
        return y

    @staticmethod
    def _grouped(counts: torch.Tensor) -> Project:
        ends = torch.cumsum(counts, 0, dtype=torch.int32)  # group e is rows [ends[e-1], ends[e])
        return lambda rows, weight: F.grouped_mm(rows, weight.transpose(1, 2), offs=ends)

    @staticmethod
    def _per_expert(counts: torch.Tensor) -> Project:
        sizes = counts.tolist()  # a host sync, on the layouts grouped_mm refuses only

        def project(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            out = rows.new_empty((rows.shape[0], weight.shape[1]))
            start = 0
            for e, n in enumerate(sizes):
                if n:
                    torch.mm(rows[start:start + n], weight[e].t(), out=out[start:start + n])
                    start += n
            return out

        return project
