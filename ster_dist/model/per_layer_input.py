"""Per-layer inputs (Gemma 3n; Gemma 4's E models): a second, narrow input for every layer, made
once per step from the tokens and their embedding, and the gate through which a Gemma 4 layer adds
its own to its output (Gemma 3n adds it to AltUp's copies instead, model/altup.py).

PerLayerInputs (the decoder's, for both families): the token's row of embed_tokens_per_layer (ids
past the table read row 0) times sqrt(width), plus per_layer_model_projection of the scaled
embedding times 1/sqrt(hidden) through per_layer_projection_norm, the sum times 2^-0.5: [...,
layers, width], as Transformers' Gemma3nTextModel and Gemma4TextModel round them. Token-wise, so the
whole read, the cached and the paged steps compute the same; the step carries the result
(`step.per_layer_inputs`) and hands each layer its own (`step.layer_input(layer)`; a compiled step's
TracedStep holds its layer's alone, model/compiled.py). The token table is split over
tensor-parallel ranks by rows, as the embedding is.

PerLayerGate (a Gemma 4 block's): per_layer_input_gate, the activation, times the layer's input,
per_layer_projection and post_per_layer_input_norm, added to the block's output. The gate's width is
split over tensor-parallel ranks like a feed-forward's (column- then row-parallel), each rank
reading its share of the layer's input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.layers.activation import activation
from ster_dist.model.norm import Norm
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import ColumnLinear, Replicated, RowLinear, VocabEmbedding


def per_layer_shape(cfg: ModelConfig) -> tuple[int, int] | None:
    """(width, vocabulary) of each layer's input and of their token table; None where the model has
    none."""
    if cfg.altup is not None:
        return cfg.altup.per_layer_width, cfg.altup.per_layer_vocab
    if cfg.per_layer_input:
        return cfg.per_layer_input, cfg.per_layer_vocab or cfg.vocab_size
    return None


class PerLayerInputs(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx):
        super().__init__()
        width, vocab = per_layer_shape(cfg)
        self.layers, self.width, self.vocab, self.hidden = (
            cfg.num_layers,
            width,
            vocab,
            cfg.hidden_size,
        )
        packed = cfg.num_layers * width  # every layer's input side by side in one row
        self.embed = VocabEmbedding(vocab, packed, ctx)
        self.projection = Replicated((packed, cfg.hidden_size))
        self.norm = Norm(
            width, cfg.norm_eps, cfg.norm_kind, offset=cfg.norm_offset, scale_f32=cfg.norm_scale_f32
        )

    def forward(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[..., layers, width] for token ids [...] and their scaled embedding [..., hidden]."""
        dtype = embedded.dtype
        table_ids = torch.where((ids >= 0) & (ids < self.vocab), ids, 0)
        rows = self.embed(table_ids) * torch.tensor(self.width**0.5).to(dtype)
        rows = rows.reshape(*ids.shape, self.layers, self.width)
        projected = F.linear(embedded, self.projection.weight) * torch.tensor(self.hidden**-0.5).to(
            dtype
        )
        projected = self.norm(projected.reshape(*embedded.shape[:-1], self.layers, self.width))
        return (projected + rows) * torch.rsqrt(torch.tensor(2.0)).to(dtype)


class PerLayerGate(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        self.layer = layer
        self.share = ctx.split(cfg.per_layer_input)
        self.gate = ColumnLinear(cfg.hidden_size, cfg.per_layer_input, (self.share,), False)
        self.projection = RowLinear(
            cfg.per_layer_input, cfg.hidden_size, ctx, False, cols=self.share
        )
        self.norm = Norm(cfg.hidden_size, cfg.norm_eps, cfg.norm_kind, offset=cfg.norm_offset)
        self.act = activation(cfg.hidden_act)

    def forward(self, h: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """What the layer adds to its output h, given its own input [..., width]
        (`step.layer_input(layer)`)."""
        start, stop = self.share
        return self.norm(self.projection(self.act(self.gate(h)) * mine[..., start:stop]))
