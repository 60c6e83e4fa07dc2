"""Attention whose query passes a bottleneck (Step3's text decoder): the hidden state is narrowed
through q_down to `ModelConfig.query_bottleneck` channels, RMS-normed there, and widened by q to
every head; keys and values are projected from the hidden state as in plain attention.

The narrow projection and its norm are small and feed every head, so each tensor-parallel rank holds
them whole; q is column-parallel over the rank's heads like plain attention's. The rest of the layer
(rotation, cache, masks, output) is model/attention.py's.
"""

from __future__ import annotations

import torch

from ster_dist.config import ModelConfig
from ster_dist.model.attention import Attention
from ster_dist.model.norm import Norm
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import ColumnLinear, FusedColumns


class BottleneckAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__(cfg, layer, ctx)
        rank, d = cfg.query_bottleneck, cfg.head_dim
        (h0, h1), _ = ctx.attention_heads(cfg.heads(layer), cfg.kv_heads(layer))
        self.q_down = ColumnLinear(cfg.hidden_size, rank, ((0, rank),), cfg.qkv_bias)
        self.q_down_norm = Norm(rank, cfg.norm_eps, offset=cfg.norm_offset)
        self.q = ColumnLinear(rank, cfg.heads(layer) * d, ((h0 * d, h1 * d),), False)
        # the hidden state's one product
        self.qkv = FusedColumns(self.q_down, self.k, self.v, self.gate)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        narrow, k, v, gate = self.qkv(x)
        return self.q(self.q_down_norm(narrow)), k, v, gate
