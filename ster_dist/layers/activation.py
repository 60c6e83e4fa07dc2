"""Activation functions by their config name, and xIELU, the activation with learned parameters per
layer (Apertus). Dense feed-forwards and experts both pick theirs here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.parallel.ctx import Shard
from ster_dist.parallel.linear import ShardedModule


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU by its tanh approximation (Gemma's gelu_pytorch_tanh): a function of its own, so a
    caller can tell it by identity (model/native_stack.py)."""
    return F.gelu(x, approximate="tanh")


def activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_exact"):
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return gelu_tanh
    if name == "relu2":
        return lambda x: F.relu(x).square()
    if name == "relu":
        return F.relu
    raise ValueError(name)


class XIELU(ShardedModule):
    """xIELU as Transformers' XIELUActivation computes it: alpha_p x^2 + beta x above zero, else
    (expm1(min(x, eps)) - x) alpha_n + beta x, with alpha_p = softplus(stored), alpha_n = beta +
    softplus(stored). Every rank holds the four stored numbers whole."""

    def __init__(self):
        super().__init__()
        for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ())):
            self._param(name, Shard(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(
            x > 0,
            alpha_p * x * x + self.beta * x,
            (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x,
        )
