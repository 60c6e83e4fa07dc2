"""AltUp (Gemma 3n): the residual stream as `copies` versions of the hidden state, [copies, batch,
seq, hidden], of which each block computes on the first alone, and the per-layer inputs added to the
others.

- AltUpStream (the decoder's): the extra copies made from the embedding, and at the end the copies
  brought back and averaged (the per-layer inputs are model/per_layer_input.py's, shared with Gemma
  4). Each made or brought-back copy is rescaled to the first's root-mean-square.
- AltUpLayer (each block's): every copy predicted from all of them by coefficients a router picks
  from the first copy; the block runs on the first prediction; every prediction corrected by the
  block's change; the per-layer input, gated by the first corrected copy, added to every copy but
  the first.

The operations follow Transformers' Gemma3nTextAltUp and Gemma3nTextModel step for step, so that
rounding agrees. Everything here is token-wise: the cached, paged and whole reads agree. The
per-layer table is split over ranks by vocabulary like the embedding; every other weight is small
and held whole on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.layers.activation import activation
from ster_dist.model.norm import Norm
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import Replicated


def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """x brought to the root-mean-square `target` over the hidden width."""
    magnitude = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude


class AltUpStream(nn.Module):
    """The decoder's ends of the stream: the copies made and brought back."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx):
        super().__init__()
        alt, hidden = cfg.altup, cfg.hidden_size
        self.projections = nn.ModuleList(
            Replicated((hidden, hidden)) for _ in range(alt.copies - 1)
        )
        self.unembed_projections = nn.ModuleList(
            Replicated((hidden, hidden)) for _ in range(alt.copies - 1)
        )

    def expand(self, embedded: torch.Tensor) -> torch.Tensor:
        """[copies, batch, seq, hidden]: the embedding and its projections, each at the embedding's
        scale."""
        target = torch.mean(embedded**2, dim=-1, keepdim=True) ** 0.5
        made = [_rescaled(F.linear(embedded, p.weight), target) for p in self.projections]
        return torch.stack([embedded, *made], dim=0)

    def collapse(self, stream: torch.Tensor) -> torch.Tensor:
        """[batch, seq, hidden]: the copies brought back, each at the first's scale, averaged."""
        target = torch.mean(stream[0] ** 2, dim=-1, keepdim=True) ** 0.5
        back = [
            _rescaled(F.linear(stream[i + 1], p.weight), target)
            for i, p in enumerate(self.unembed_projections)
        ]
        return torch.mean(torch.stack([stream[0], *back]), dim=0)


class AltUpLayer(nn.Module):
    """One block's predict, run, correct and per-layer input, around the block's own computation."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        alt, hidden = cfg.altup, cfg.hidden_size
        self.layer, self.copies, self.hidden = layer, alt.copies, hidden
        self.correct_scale = alt.correct_scale
        self.correct_output_scale = Replicated((hidden,))
        self.correction_coefs = Replicated((alt.copies, alt.copies))
        self.prediction_coefs = Replicated((alt.copies**2, alt.copies))
        self.modality_router = Replicated((alt.copies, hidden))
        self.router_norm = Norm(
            hidden, cfg.norm_eps, offset=cfg.norm_offset, scale_f32=cfg.norm_scale_f32
        )
        self.input_gate = Replicated((alt.per_layer_width, hidden))
        self.input_projection = Replicated((hidden, alt.per_layer_width))
        self.input_norm = Norm(
            hidden, cfg.norm_eps, offset=cfg.norm_offset, scale_f32=cfg.norm_scale_f32
        )
        self.act = activation(cfg.hidden_act)

    def forward(
        self, stream: torch.Tensor, step, block: Callable[[torch.Tensor, object], torch.Tensor]
    ) -> torch.Tensor:
        """The copies after this layer: `block(x, step)` is the block's own computation on one
        hidden state."""
        predictions = self._predict(stream)
        corrected = self._correct(predictions, block(predictions[0], step))
        first = corrected[0]
        if self.correct_scale:
            scale = self.correct_output_scale.weight
            first = (first.type_as(scale) * scale).type_as(corrected)
        gated = self.act(F.linear(first, self.input_gate.weight)) * step.layer_input(self.layer)
        added = self.input_norm(F.linear(gated, self.input_projection.weight))
        return torch.cat((corrected[:1], corrected[1:] + added))

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = F.linear(
            self.router_norm(x) * torch.tensor(self.hidden**-1.0), self.modality_router.weight
        )
        return torch.tanh(routed.float()).type_as(x)

    def _predict(self, stream: torch.Tensor) -> torch.Tensor:
        modalities = self._modalities(stream[0])
        coefs = (
            F.linear(modalities, self.prediction_coefs.weight)
            .reshape(*modalities.shape[:-1], self.copies, self.copies)
            .permute(0, 1, 3, 2)
        )
        predictions = torch.matmul(stream.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2)
        return (predictions + stream).contiguous().type_as(stream)

    def _correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        modalities = self._modalities(activated)
        innovation = (activated - predictions[0]).repeat(self.copies, 1, 1, 1)
        coefs = (
            (F.linear(modalities, self.correction_coefs.weight) + 1.0)
            .permute(2, 0, 1)
            .unsqueeze(-1)
        )
        return (innovation * coefs + predictions).contiguous().type_as(activated)
