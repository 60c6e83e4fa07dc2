"""Experts beside a dense feed-forward (Gemma 4's enable_moe_block): the dense feed-forward reads
the block's normed input as usual; the experts read the residual through a norm of their own, and
the router reads the residual itself; each output passes its own norm, and the two are summed.

It is the dense feed-forward (its parameters at the usual names, so a layer's dense part loads,
merges and takes adapters as any dense layer's) with an MoE layer (`moe`: router and experts, split
and dispatched as there) and three norms beside it. The block hands it the residual
(`reads_residual`).
"""

from __future__ import annotations

import torch

from ster_dist.config import ModelConfig
from ster_dist.layers.mlp import MLP
from ster_dist.model.norm import Norm
from ster_dist.moe.layer import MoE
from ster_dist.parallel.ctx import ParallelCtx


class ExpertsBesideDense(MLP):
    reads_residual = True

    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx, layer: int):
        super().__init__(cfg, ctx)

        def norm() -> Norm:
            return Norm(cfg.hidden_size, cfg.norm_eps, cfg.norm_kind, offset=cfg.norm_offset)

        self.moe = MoE(cfg, ctx, layer)
        self.dense_post_norm, self.experts_norm, self.experts_post_norm = norm(), norm(), norm()

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x: the block's normed input to its feed-forward; residual: that norm's input."""
        dense = self.dense_post_norm(super().forward(x))
        experts = self.experts_post_norm(self.moe(self.experts_norm(residual), route_from=residual))
        return dense + experts
