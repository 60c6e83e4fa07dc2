"""Norms: RMSNorm and LayerNorm, with or without bias, scales stored as-is or as an offset from one.

An RMS norm scales in the input's dtype after casting back (Llama), or in f32 before it
(`scale_f32`: Gemma 3n; a scale stored as an offset from one is always applied in f32). `heads` > 0
normalises each head_dim slice separately (per-head query/key norms); `groups` > 1 normalises each
of that many equal slices of the width apart before the one stored scale (K2-Horizon's grouped
norms); per_head_weight gives each head its own scale ([heads, head_dim]). A norm over a projection
split across ranks (OLMo 2's whole-projection query/key norm) sums its statistics over the ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.parallel.ctx import SINGLE, ParallelCtx, Shard
from ster_dist.parallel.linear import ShardedModule


class Norm(ShardedModule):
    def __init__(
        self,
        dim: int,
        eps: float,
        kind: str = "rms",
        bias: bool = False,
        offset: float = 0.0,
        affine: bool = True,
        heads: int = 0,
        per_head_weight: bool = False,
        rows: tuple[tuple[int, int], ...] | None = None,
        ctx: ParallelCtx = SINGLE,
        scale_f32: bool = False,
        groups: int = 1,
    ):
        """dim: the normalised width. rows: this rank's share of a weight split like a
        projection."""
        super().__init__()
        self.eps, self.kind, self.offset, self.heads, self.ctx = eps, kind, offset, heads, ctx
        self.scale_f32, self.groups = scale_f32, groups
        self.split = rows is not None and not heads  # a whole projection split over ranks
        if per_head_weight:
            shape, shard = (
                (heads, dim),
                Shard((heads, dim), 0, rows) if rows else Shard((heads, dim)),
            )
        elif rows is not None:
            shape, shard = (dim,), Shard((dim,), 0, rows)
        else:
            shape, shard = (dim,), Shard((dim,))
        self.global_dim = shape[-1]
        if affine:
            self._param("weight", shard)
            if bias:
                self._param("bias", shard)
            else:
                self.bias = None
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        if self.heads:  # [..., heads * head_dim] -> [..., heads, head_dim]
            h = h.unflatten(-1, (-1, self.global_dim))
        if self.split:
            h = self._split_rms(h)
        elif self.kind == "rms" and self.groups > 1:
            h = h.unflatten(-1, (self.groups, -1))
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        elif self.kind == "rms":
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            h = F.layer_norm(h, h.shape[-1:], eps=self.eps)
        if self.weight is not None:
            # the scale widened only where it is applied in f32: Llama's casts back first (an eager
            # op saved
            # a norm, 20 us of a bf16 decode step's final norm)
            if self.offset:
                h = h * (self.offset + self.weight.float())
            # Llama casts back before scaling; kept for bf16 parity
            elif self.kind == "rms" and not self.scale_f32:
                h = h.to(dtype) * self.weight
            else:
                h = h * self.weight.float()
            if self.bias is not None:
                h = h + self.bias.float()
        if self.heads:
            h = h.flatten(-2)
        return h.to(dtype)

    def _split_rms(self, h: torch.Tensor) -> torch.Tensor:
        square_sum = self.ctx.all_reduce(h.pow(2).sum(-1, keepdim=True))
        return h * torch.rsqrt(square_sum / self.global_dim + self.eps)
