"""Per-layer inputs (Gemma 4's E models): a second, narrow input for every layer, made once per step from the
tokens and their embedding, and the gate through which each layer adds it to its output.

PerLayerInputs (the decoder's): the token's row of embed_tokens_per_layer times sqrt(width), plus
per_layer_model_projection of the scaled embedding times 1/sqrt(hidden) through per_layer_projection_norm,
the sum times 2^-0.5: [..., layers, width]. Token-wise, so the whole read, the cached and the paged steps
compute the same. The token table is split over tensor-parallel ranks by rows, as the embedding is.

PerLayerGate (a block's): per_layer_input_gate, the activation, times the layer's input, per_layer_projection
and post_per_layer_input_norm, added to the block's output. The gate's width is split over tensor-parallel
ranks like a feed-forward's (column- then row-parallel), each rank reading its share of the layer's input.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.layers.activation import activation
from ster_dist.model.norm import Norm
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import ColumnLinear, Replicated, RowLinear, VocabEmbedding, dense


class PerLayerInputs(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx):
        super().__init__()
        self.layers, self.width, self.hidden = cfg.num_layers, cfg.per_layer_input, cfg.hidden_size
        packed = cfg.num_layers * cfg.per_layer_input  # every layer's input side by side in one row
        self.embed = VocabEmbedding(cfg.per_layer_vocab or cfg.vocab_size, packed, ctx)
        self.projection = Replicated((packed, cfg.hidden_size))
        self.norm = Norm(cfg.per_layer_input, cfg.norm_eps, cfg.norm_kind, offset=cfg.norm_offset)

    def forward(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[..., layers, width] for token ids [...] and their scaled embedding [..., hidden]."""
        tokens = self.embed(ids) * torch.tensor(math.sqrt(self.width), dtype=embedded.dtype)
        projected = dense(embedded, self.projection.weight) * torch.tensor(self.hidden ** -0.5, dtype=embedded.dtype)
        projected = self.norm(projected.unflatten(-1, (self.layers, self.width)))
        return (projected + tokens.unflatten(-1, (self.layers, self.width))) * torch.tensor(2 ** -0.5,
                                                                                            dtype=embedded.dtype)


class PerLayerGate(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        self.layer = layer
        self.share = ctx.split(cfg.per_layer_input)
        self.gate = ColumnLinear(cfg.hidden_size, cfg.per_layer_input, (self.share,), False)
        self.projection = RowLinear(cfg.per_layer_input, cfg.hidden_size, ctx, False, cols=self.share)
        self.norm = Norm(cfg.hidden_size, cfg.norm_eps, cfg.norm_kind, offset=cfg.norm_offset)
        self.act = activation(cfg.hidden_act)

    def forward(self, h: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """What the layer adds to its output h, given every layer's inputs [..., layers, width]."""
        start, stop = self.share
        mine = inputs[..., self.layer, start:stop]
        return self.norm(self.projection(self.act(self.gate(h)) * mine))
