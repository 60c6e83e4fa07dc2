"""Zamba2's hybrid layer (the "mamba2_shared_block" kind): a transformer block several layers share,
then a Mamba-2 layer (model/mamba2.py), as Transformers' Zamba2HybridLayer computes them.

The shared block reads the hidden state beside the token embeddings ([h, embeddings], twice the
hidden width): an RMS norm over that width, attention (model/attention.py) over it, an RMS norm and
the gated feed-forward (layers/mlp.py), with no residual of its own. Its output, through this
layer's own linear, is added to the Mamba-2 layer's input before that layer's norm, not to the
residual stream.

num_mem_blocks blocks serve the hybrid layers round-robin (hybrid layer k uses block k %
num_mem_blocks). The first layer using a block holds its weights; the later ones are tied to them
(where tie_word_embeddings is true: Transformers ties nothing otherwise, and every layer then holds
a block of its own) (`shares_with`: the decoder calls parallel/linear.py tie_parameters), so the
checkpoint's one copy is read once and held once, while each layer keeps its own keys and values in
the cache. Each hybrid layer k has its own low-rank adapters (slot k of its block), on the
feed-forward's gate_up projection and, under use_shared_attention_adapter, on q, k and v; they are
stored in the block, as Transformers stores them, and each layer attaches its slot's to its own
copies of the projections (ColumnLinear.adapters), so they add to the projection's output as
Transformers adds them.

Tensor parallelism: attention and feed-forward split as everywhere else; an adapter's A is whole on
every rank and its B split like the rows it adds to; the per-layer linear is whole on every rank (it
reads the reduced block output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.layers.mlp import MLP
from ster_dist.model.attention import Attention
from ster_dist.model.mamba2 import Mamba2Mixer
from ster_dist.model.norm import Norm
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ColumnLinear, ShardedModule


class LowRankWeights(ShardedModule):
    """One stored adapter's factors: a [rank, inputs] whole, b [outputs, rank] this rank's
    `rows`."""

    def __init__(self, inputs: int, outputs: int, rank: int, rows: tuple[tuple[int, int], ...]):
        super().__init__()
        self._param("a", Shard((rank, inputs)))
        self._param("b", Shard((outputs, rank), 0, rows))


class AdapterRows:
    """The share of an adapter one projection adds: (x a^T) b[start:stop]^T (gate_up's adapter feeds
    two)."""

    def __init__(self, weights: LowRankWeights, start: int, stop: int):
        self.weights, self.start, self.stop = weights, start, stop

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.weights.a), self.weights.b[self.start : self.stop])


class SharedSettings:
    """Where a hybrid layer stands among them: its slot, its block's first layer and its block's
    slots."""

    def __init__(self, cfg: ModelConfig, layer: int):
        raw = cfg.raw
        layers, blocks, rank = (
            raw.get("shared_block_layers"),
            raw.get("num_mem_blocks"),
            raw.get("adapter_rank"),
        )
        for key, value in (("num_mem_blocks", blocks), ("adapter_rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise Refusal(
                    f"invalid model config: {key} is {value!r}; Zamba2's shared blocks need a positive "
                    "integer there"
                )
        self.slot = layers.index(layer)
        block = self.slot % blocks
        # Transformers ties the layers of a block only where tie_word_embeddings is true (it gates
        # all its
        # tying on that key); untied, every hybrid layer has a block of its own, stored under its
        # own name
        self.owner = layers[block] if cfg.tie_word_embeddings else layer
        self.slots = tuple(k for k in range(len(layers)) if k % blocks == block)
        self.rank = rank
        self.attention_adapters = bool(raw.get("use_shared_attention_adapter"))
        if self.attention_adapters and cfg.num_kv_heads != cfg.num_heads:
            raise Refusal(
                f"invalid model config: use_shared_attention_adapter with {cfg.num_kv_heads} key-value "
                f"heads for {cfg.num_heads} heads; Zamba2's key and value adapters are as wide as the "
                "queries, so set num_key_value_heads to num_attention_heads"
            )


class SharedBlock(nn.Module):
    """The shared transformer block as this layer holds it (tied to its block's first layer) and its
    block's adapter slots; `attach(slot)` hangs that slot's adapters on this copy's projections."""

    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx, s: SharedSettings):
        super().__init__()
        hidden, d, inner = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        self.attn_norm = Norm(2 * hidden, cfg.norm_eps)
        self.attn = Attention(cfg, layer, ctx, in_features=2 * hidden)
        self.mlp_norm = Norm(hidden, cfg.norm_eps)
        self.mlp = MLP(cfg, ctx)
        if self.mlp.gate is None:
            raise Refusal(
                "Zamba2's shared feed-forward is gated (gate_up_proj); the family spec must say so"
            )
        (h0, h1), (k0, k1) = ctx.attention_heads(cfg.num_heads, cfg.num_kv_heads)
        q_rows, kv_rows = ((h0 * d, h1 * d),), ((k0 * d, k1 * d),)
        a, b = ctx.split(inner)

        def slots(outputs, inputs, rows):
            return nn.ModuleDict(
                {str(k): LowRankWeights(inputs, outputs, s.rank, rows) for k in s.slots}
            )

        if s.attention_adapters:
            self.q_adapters = slots(cfg.num_heads * d, 2 * hidden, q_rows)
            self.k_adapters = slots(cfg.num_kv_heads * d, 2 * hidden, kv_rows)
            self.v_adapters = slots(cfg.num_kv_heads * d, 2 * hidden, kv_rows)
        # gate_up's adapter: the gate's rows, then the up projection's, each split like them
        self.gate_up_adapters = slots(2 * inner, hidden, ((a, b), (inner + a, inner + b)))
        self.local_inner = b - a

    def attach(self, slot: int) -> None:
        if hasattr(self, "q_adapters"):
            for projection, stored in (
                (self.attn.q, self.q_adapters),
                (self.attn.k, self.k_adapters),
                (self.attn.v, self.v_adapters),
            ):
                weights = stored[str(slot)]
                projection.adapters.append(
                    AdapterRows(weights, 0, weights.shards["b"].local_shape()[0])
                )
        gate_up, n = self.gate_up_adapters[str(slot)], self.local_inner
        self.mlp.gate.adapters.append(AdapterRows(gate_up, 0, n))
        self.mlp.up.adapters.append(AdapterRows(gate_up, n, 2 * n))

    def forward(self, x: torch.Tensor, embeddings: torch.Tensor, step) -> torch.Tensor:
        h = self.attn(self.attn_norm(torch.cat([x, embeddings], dim=-1)), step)
        return self.mlp(self.mlp_norm(h))


class Mamba2SharedBlock(nn.Module):
    """One hybrid layer: the shared block over the un-normed input and the embeddings, this layer's
    linear, then the Mamba-2 layer behind its own norm over the input plus that. The block adds the
    residual (input only). It keeps keys and values (kv_shape) and a recurrent state (state_shapes)
    under its layer index."""

    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        s = SharedSettings(cfg, layer)
        self.shares_with = s.owner if s.owner != layer else None
        self.shared = SharedBlock(cfg, layer, ctx, s)
        self.shared.attach(s.slot)
        hidden = cfg.hidden_size
        self.linear = ColumnLinear(hidden, hidden, ((0, hidden),), False)
        self.norm = Norm(hidden, cfg.norm_eps)
        self.mamba = Mamba2Mixer(cfg, layer, ctx)
        self.kv_shape = self.shared.attn.kv_shape

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.mamba.state_shapes()

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        t = self.linear(self.shared(x, step.embeddings, step))
        return self.mamba(self.norm(x + t), step)
