"""Laurel (Gemma 3n's learned augmented residual): the normed block input through a low-rank pair of
projections and a norm, added to that input. The block averages it with attention's residual sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.model.norm import Norm
from ster_dist.parallel.linear import Replicated


class Laurel(nn.Module):
    """x + norm(right(left(x))); small enough that every rank holds it whole."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.left = Replicated((cfg.laurel_rank, cfg.hidden_size))
        self.right = Replicated((cfg.hidden_size, cfg.laurel_rank))
        self.norm = Norm(
            cfg.hidden_size, cfg.norm_eps, offset=cfg.norm_offset, scale_f32=cfg.norm_scale_f32
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(F.linear(F.linear(x, self.left.weight), self.right.weight))
