"""DeepSeek-V4's attention, one layer kind for its three layer types (V4Layer.kind, picked per
layer):

- every layer: queries from a latent (q_a_proj, q_a_norm, q_b_proj), each head RMS-normed without a
  scale; one key-value head (kv_proj, kv_norm) that is both key and value; the trailing rope_dim
  channels of each head turn by adjacent pairs; a learned sink logit per head joins every softmax;
  every key within `window` positions is seen; the output's turned channels are turned back at the
  query's position, then o_a_proj projects each of o_groups head groups to o_lora_rank and o_b_proj
  mixes them;
- "heavily_compressed_attention": a window compressor (model/window_compressor.py) at the heavy
  rate; a query also sees every entry whose window closed at or before it;
- "compressed_sparse_attention": the compressor at the sparse rate with two overlapping series, and
  a query sees only the entries the Lightning Indexer (model/compressed_indexer.py) keeps for it.

The cache keeps the key-value head in the key slot and, on compressed layers, the compressor's and
the indexer's raw projections in the value slot (sliding layers one zero channel there), from which
the entries are rebuilt at every step: both caches carry the state across decode calls without a
store of their own. Under tensor parallelism the query heads (whole head groups, with their sinks
and o_a_proj rows) are split and o_b_proj's columns with them; the key-value head, the compressor
and the indexer are small and held whole on every rank (as vLLM replicates them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ster_dist.config import RopeConfig
from ster_dist.errors import Refusal
from ster_dist.model.attention import HeadScalars
from ster_dist.model.compressed_indexer import CompressedIndexer
from ster_dist.model.host import upload
from ster_dist.model.norm import Norm
from ster_dist.model.window_compressor import WindowCompressor, by_position, rotate_tail
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import ColumnLinear, RowLinear

SLIDING, SPARSE, HEAVY = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


@dataclass(frozen=True)
class V4Layer:
    """One DeepSeek-V4 attention layer's sizes (global) and settings."""

    kind: str  # SLIDING | SPARSE | HEAVY
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_rank: int
    o_groups: int
    o_rank: int
    window: int
    # the layer's rotation (sliding layers' rope_theta; compressed layers' compress rope)
    rope: RopeConfig
    eps: float
    rate: int = 0  # the compressor's window (compressed layers)
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0


class CompressedAttention(nn.Module):
    def __init__(self, v4: V4Layer, layer: int, ctx: ParallelCtx):
        super().__init__()
        d, heads = v4.head_dim, v4.heads
        (h0, h1), _ = ctx.attention_heads(heads, heads)
        # an output group is a run of heads * head_dim / o_groups channels: several heads, or part
        # of one (4 heads
        # in o_groups 8), as Transformers reshapes the heads' output
        width = heads * d // v4.o_groups
        if (heads * d) % v4.o_groups or (h0 * d) % width or (h1 * d) % width:
            raise Refusal(
                f"{heads} heads in {v4.o_groups} output groups do not split over {ctx.tp_size} "
                "tensor-parallel ranks by whole groups; use a --tp that divides o_groups"
            )
        g0, g1 = h0 * d // width, h1 * d // width
        self.v4, self.layer, self.local_heads, self.local_groups = v4, layer, h1 - h0, g1 - g0
        self.q_a = ColumnLinear(v4.hidden, v4.q_rank, ((0, v4.q_rank),), False)
        self.q_a_norm = Norm(v4.q_rank, v4.eps, scale_f32=True)
        self.q_b = ColumnLinear(v4.q_rank, heads * d, ((h0 * d, h1 * d),), False)
        self.q_b_norm = Norm(d, v4.eps, affine=False)
        self.kv = ColumnLinear(v4.hidden, d, ((0, d),), False)
        self.kv_norm = Norm(d, v4.eps, scale_f32=True)
        rank = v4.o_rank
        self.o_a = ColumnLinear(
            heads * d // v4.o_groups, v4.o_groups * rank, ((g0 * rank, g1 * rank),), False
        )
        self.o_b = RowLinear(v4.o_groups * rank, v4.hidden, ctx, False, cols=(g0 * rank, g1 * rank))
        self.sinks = HeadScalars(heads, (h0, h1))
        self.compressor = self.indexer = None
        if v4.kind != SLIDING:
            self.compressor = WindowCompressor(v4.hidden, d, v4.rate, v4.kind == SPARSE, v4.eps)
        if v4.kind == SPARSE:
            self.indexer = CompressedIndexer(
                v4.hidden, v4.q_rank, v4.index_heads, v4.index_dim, v4.index_topk, v4.rate, v4.eps
            )
        raw = (self.compressor.cache_width if self.compressor else 0) + (
            self.indexer.compressor.cache_width if self.indexer else 0
        )
        # sliding layers keep nothing beside the key-value head: one zero channel, since a cache
        # slot has width
        self.raw_width = raw
        self.kv_shape = ((1, d), (1, max(raw, 1)))
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor, pos) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.v4.head_dim
        q_latent = self.q_a_norm(self.q_a(x))
        q = self.q_b_norm(self.q_b(q_latent).view(b, t, self.local_heads, d).transpose(1, 2))
        cos, sin = pos.rotary(self.v4.rope, x.dtype)
        q = rotate_tail(q, cos, sin)
        kv = rotate_tail(self.kv_norm(self.kv(x)).unsqueeze(1), cos, sin)  # [b, 1, t, d]
        parts = [] if self.compressor is None else [self.compressor.project(x)]
        queries = (q, pos.positions.reshape(-1, 1, t, 1).expand(b, 1, t, 1))
        if self.indexer is not None:
            parts.append(self.indexer.compressor.project(x))
            queries += self.indexer.queries(x, q_latent, cos, sin)
        raw = torch.cat(parts, dim=-1).to(kv.dtype) if parts else kv.new_zeros(b, 1, t, 1)
        out = pos.attend(
            self.layer, queries, kv, raw, None, partial(self._attend, pos.tables, pos.key_reach)
        )
        out = rotate_tail(out, cos, -sin).transpose(1, 2)  # [b, t, heads, d]
        groups = out.reshape(b, t, self.local_groups, -1)
        w = self.o_a.plain().view(self.local_groups, self.v4.o_rank, -1)
        grouped = torch.einsum("btgi,gri->btgr", groups, w).flatten(2)
        return self.o_b(grouped)

    def _attend(self, tables, reach: int, queries, kv, raw, mask, key_pos) -> torch.Tensor:
        """[n, heads, t, d] over the keys within the window and the compressed entries each query
        sees."""
        # [n, heads, t, d], [n, t]
        q, query_pos = queries[0], queries[1][:, 0, :, 0]
        n, _, t, _ = q.shape
        causal = (
            mask[:, 0]
            if mask is not None
            else torch.ones(n, t, kv.shape[2], dtype=torch.bool, device=q.device)
        )
        near = causal & (query_pos.unsqueeze(2) - key_pos.unsqueeze(1) < self.v4.window)
        keys, allowed = kv, near
        if self.compressor is not None:
            entries, seen = self._entries(tables, reach, queries, raw, causal, key_pos, query_pos)
            if entries is not None:
                keys = torch.cat((kv, entries.unsqueeze(1).to(kv.dtype)), dim=2)
                allowed = torch.cat((near, seen), dim=-1)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        scores = scores.float().masked_fill(~allowed.unsqueeze(1), float("-inf"))
        sink = self.sinks.weight.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs.to(keys.dtype), keys.expand(-1, q.shape[1], -1, -1))

    def _entries(self, tables, reach: int, queries, raw, causal, key_pos, query_pos):
        """(entries [n, windows, d], which each query sees [n, t, windows]) from the keys' raw
        projections, or (None, None) before the first window closes. reach: one past the largest key
        position (the step's key_reach, from the host): windows past a query's own position are
        built but never seen."""
        real = causal[:, -1]  # the last query (a real token) sees every real key up to it
        rate = self.v4.rate
        windows = reach // rate
        if windows == 0:
            return None, None
        # on the host, as the tables are
        firsts = (torch.arange(windows) * rate).expand(raw.shape[0], -1)
        cos, sin = (upload(t, raw.device) for t in tables.lookup(self.v4.rope, firsts, raw.dtype))
        laid = by_position(raw, key_pos, real, windows * rate)
        width = self.compressor.cache_width
        entries = self.compressor.entries(laid[..., :width], windows, cos, sin)
        # a window's last position + 1
        closes = (torch.arange(windows, device=key_pos.device) + 1) * rate
        seen = closes.view(1, 1, -1) <= query_pos.unsqueeze(-1) + 1
        if self.indexer is not None:
            index_keys = self.indexer.compressor.entries(laid[..., width:], windows, cos, sin)
            seen = self.indexer.choose(queries[2:], index_keys, seen)
        return entries, seen


def v4_layer(cfg, layer: int) -> V4Layer:
    """Layer `layer`'s sizes and settings from a DeepSeek-V4 config (families/deepseek_v4.py writes
    the v4_ keys)."""
    raw = cfg.raw
    kind, rope_dim = raw["v4_layer_types"][layer], raw["qk_rope_head_dim"]
    if kind == SLIDING:
        rope = RopeConfig(theta=float(raw["rope_theta"]), rotary_dim=rope_dim, interleaved=True)
    else:
        p = raw["v4_compress_rope"]
        kind_of_rope = p.get("rope_type", "default")
        if kind_of_rope not in ("default", "yarn"):
            raise Refusal(
                f"DeepSeek-V4's compressed layers rotate with rope_type {kind_of_rope!r}, which is not "
                "supported; use default or yarn"
            )
        yarn = (
            {}
            if kind_of_rope == "default"
            else dict(
                rope_type="yarn",
                factor=float(p["factor"]),
                original_max_position=int(p["original_max_position_embeddings"]),
                beta_fast=float(p.get("beta_fast", 32.0)),
                beta_slow=float(p.get("beta_slow", 1.0)),
                attention_factor=float(p.get("attention_factor", 1.0)),
                truncate=bool(p.get("truncate", True)),
            )
        )
        rope = RopeConfig(
            theta=float(p["rope_theta"]), rotary_dim=rope_dim, interleaved=True, **yarn
        )
    return V4Layer(
        kind=kind,
        hidden=cfg.hidden_size,
        heads=cfg.num_heads,
        head_dim=int(raw["head_dim"]),
        rope_dim=rope_dim,
        q_rank=int(raw["q_lora_rank"]),
        o_groups=int(raw["o_groups"]),
        o_rank=int(raw["o_lora_rank"]),
        window=int(raw["v4_window"]),
        rope=rope,
        eps=cfg.norm_eps,
        rate=int(raw["v4_compress_rates"][kind]) if kind != SLIDING else 0,
        index_heads=int(raw["index_n_heads"]),
        index_dim=int(raw["index_head_dim"]),
        index_topk=int(raw["index_topk"]),
    )
