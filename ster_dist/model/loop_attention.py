"""Loop attention (IQuest-LoopCoder): attention whose later passes mix two reads of the same rotated
queries.

A looped model's layer of the first pass attends as plain attention. The same stored layer on a
later pass (model/loop.py: loop_layers stored layers, every pass its own layers and cache slots)
reads twice: globally, over the keys and values the first pass's layer stored (its cache,
`attend_again`; no keys of its own go there), and locally, over its own pass's keys within the
config's window (the layer's sliding window). Per head, a gate g = sigmoid(w_h . q_h + b_h) of the
rotated query weighs them, g * global + (1 - g) * local, before the output projection. The gate's
weight ([heads, head_dim]) and bias ([heads]) are the stored layer's, held by every pass's layer
(the first never uses them) so passes tie alike, and split by heads under tensor parallelism like
the queries.
"""

from __future__ import annotations

import torch

from ster_dist.config import ModelConfig
from ster_dist.model.attention import Attention
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ShardedModule


class HeadGate(ShardedModule):
    """One weight row and one bias per attention head, split with the heads."""

    def __init__(self, heads: int, head_dim: int, rows: tuple[int, int]):
        super().__init__()
        self._param("weight", Shard((heads, head_dim), 0, (rows,)))
        self._param("bias", Shard((heads,), 0, (rows,)))


class LoopAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__(cfg, layer, ctx)
        (h0, h1), _ = ctx.attention_heads(cfg.heads(layer), cfg.kv_heads(layer))
        self.loop_gate = HeadGate(cfg.heads(layer), cfg.head_dim, (h0, h1))
        # the first pass's layer whose keys a later pass reads globally; None: this layer is of the
        # first pass
        self.first_pass = layer % cfg.loop_layers if layer >= cfg.loop_layers else None

    def forward(self, x: torch.Tensor, pos) -> torch.Tensor:
        q, k, v, gate = self._project(x, pos)
        local = pos.attend(self.layer, q, k, v, self.window, self._attend_at, self.chunk)
        if self.first_pass is None:
            # without a cache a later pass reads these from the step (StepState.attend_again)
            pos.handed_on[("loop_keys", self.layer)] = (k, v)
            return self._output(local, gate)
        whole = pos.attend_again(
            self.first_pass, q, self._attend_at, pos.handed_on.get(("loop_keys", self.first_pass))
        )
        logits = torch.einsum("bhtd,hd->bht", q, self.loop_gate.weight.to(q.dtype))
        g = torch.sigmoid(logits + self.loop_gate.bias.to(q.dtype).view(1, -1, 1)).unsqueeze(-1)
        return self._output(whole * g + local * (1 - g), gate)
