"""Feed-forwards: gated (act(gate) * up) or plain (act(up)), column- then row-parallel; xIELU, the activation
with learned parameters per layer (Apertus)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.shard.ctx import ParallelCtx, Shard
from ster_dist.shard.linear import ColumnLinear, RowLinear, ShardedModule


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


class XIELU(ShardedModule):
    """xIELU as Transformers' XIELUActivation computes it: alpha_p x^2 + beta x above zero, else
    (expm1(min(x, eps)) - x) alpha_n + beta x, with alpha_p = softplus(stored), alpha_n = beta + softplus(stored).
    Every rank holds the four stored numbers whole."""

    def __init__(self):
        super().__init__()
        for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ())):
            self._param(name, Shard(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx, intermediate: int | None = None):
        super().__init__()
        inner = intermediate or cfg.intermediate_size
        rows = (ctx.split(inner),)
        self.gate = ColumnLinear(cfg.hidden_size, inner, rows, cfg.mlp_up_bias) if cfg.mlp_gated else None
        self.up = ColumnLinear(cfg.hidden_size, inner, rows, cfg.mlp_up_bias)
        self.down = RowLinear(inner, cfg.hidden_size, ctx, cfg.mlp_down_bias, cols=rows[0])
        self.act = XIELU() if cfg.hidden_act == "xielu" else activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = self.act(self.gate(x)) * h if self.gate is not None else self.act(h)
        return self.down(h)
