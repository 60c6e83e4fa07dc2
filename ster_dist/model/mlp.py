"""Feed-forwards: gated (act(gate) * up) or plain (act(up)), column- then row-parallel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.shard.ctx import ParallelCtx
from ster_dist.shard.linear import ColumnLinear, RowLinear


def activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_exact"):
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu2":
        return lambda x: F.relu(x).square()
    if name == "relu":
        return F.relu
    raise ValueError(name)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx, intermediate: int | None = None):
        super().__init__()
        inner = intermediate or cfg.intermediate_size
        rows = (ctx.split(inner),)
        self.gate = ColumnLinear(cfg.hidden_size, inner, rows, cfg.mlp_up_bias) if cfg.mlp_gated else None
        self.up = ColumnLinear(cfg.hidden_size, inner, rows, cfg.mlp_up_bias)
        self.down = RowLinear(inner, cfg.hidden_size, ctx, cfg.mlp_down_bias, cols=rows[0])
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = self.act(self.gate(x)) * h if self.gate is not None else self.act(h)
        return self.down(h)
