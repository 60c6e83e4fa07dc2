"""DeepSeek Sparse Attention's indexer (deepseek_v32, glm_moe_dsa, hy_v4): which index_topk keys
each query of a latent-attention layer may attend.

Its own small projections score every query against every key the layer sees: wq_b turns the query's
normed latent (q_a_layernorm's output) into index_n_heads heads of index_head_dim, wk and k_norm (a
LayerNorm with bias) turn the input into one key shared by those heads, the first qk_rope_head_dim
channels of both rotate (halves for DeepSeek-V3.2, adjacent pairs for GLM-DSA; HY V4 rotates the
last qk_rope_head_dim channels by halves, index_rope_tail) on the layer's rotary table, and
weights_proj weighs the heads per query. A query's score for a key is sum_h weight_h * relu(q_h . k
/ sqrt(index_head_dim)), in f32 as Transformers computes it; the query keeps its index_topk best
keys among those causality allows, so a sequence no longer than index_topk attends densely.

The indexer's keys are cached beside the layer's own (model/mla.py widens its cache slot), so a step
continued from a static or paged cache scores the same keys as the whole read. Under tensor
parallelism every projection is held whole on every rank (vLLM's convention): each rank chooses the
same keys for its own attention heads without an exchange.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.model.norm import Norm
from ster_dist.model.rope import apply_rotary
from ster_dist.parallel.linear import ColumnLinear

INDEX_KEY_NORM_EPS = 1e-6  # the indexer's k_norm keeps LayerNorm's fixed epsilon in both releases
SCORE_BLOCK = 1 << 26  # f32 per-head scores held at once while choosing (256 MiB)


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw, hidden = cfg.raw, cfg.hidden_size
        self.heads, self.head_dim, self.topk = (
            raw["index_n_heads"],
            raw["index_head_dim"],
            raw["index_topk"],
        )
        self.rope_dim, self.interleaved = (
            cfg.mla.qk_rope_head_dim,
            bool(raw["index_rope_interleave"]),
        )
        whole = self.heads * self.head_dim
        self.wq_b = ColumnLinear(cfg.mla.q_lora_rank, whole, ((0, whole),), False)
        self.wk = ColumnLinear(hidden, self.head_dim, ((0, self.head_dim),), False)
        self.rope_tail = bool(raw.get("index_rope_tail"))
        # HY V4's k_norm is at rms_norm_eps (its normalisation states index_k_norm_eps)
        self.k_norm = Norm(
            self.head_dim,
            float(raw.get("index_k_norm_eps") or INDEX_KEY_NORM_EPS),
            kind="layer",
            bias=True,
        )
        self.weights_proj = ColumnLinear(hidden, self.heads, ((0, self.heads),), False)
        self.cache_width = self.head_dim  # what each token leaves in the layer's cache slot

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, cos, sin):
        """(queries [b, heads, t, d], head weights [b, 1, t, heads] in f32) and this step's keys [b,
        1, t, d]."""
        b, t, _ = x.shape
        q = self.wq_b(q_latent).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        # the rotated share comes first here (unless rope_tail), unlike the layer's own heads
        if cos is not None:
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        # weights_proj in f32, as Transformers keeps it
        weights = F.linear(x.float(), self.weights_proj.plain().float()) * self.heads**-0.5
        return (q, weights.unsqueeze(1)), k

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.rope_tail:
            return apply_rotary(x, cos, sin, self.interleaved)
        kept, rotated = x.split([self.head_dim - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat((kept, apply_rotary(rotated, cos, sin, self.interleaved)), dim=-1)

    def choose(
        self,
        queries,
        keys: torch.Tensor,
        mask: torch.Tensor | None,
        key_pos: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The allowed pairs [n, 1, t, s] narrowed to each query's index_topk best keys (`mask`:
        those causality allows, None for all); `mask` itself when no query sees more keys than
        that."""
        q, weights = queries
        n, _, t, _ = q.shape
        s = keys.shape[2]
        if s <= self.topk:
            return mask
        keys = keys.float().transpose(-1, -2)
        # the per-head scores [n, heads, queries, s] of a long prefill are far larger than their
        # sum: a block of
        # queries at a time (each query's row is computed alike whatever the block)
        block = max(1, SCORE_BLOCK // (n * self.heads * s))
        index = torch.cat(
            [
                self._scores(q[:, :, i : i + block], weights[:, :, i : i + block], keys)
                for i in range(0, t, block)
            ],
            dim=1,
        )  # [n, t, s]
        if mask is not None:
            index = index.masked_fill(~mask[:, 0], float("-inf"))
        chosen = torch.zeros_like(index, dtype=torch.bool).scatter_(
            -1, index.topk(self.topk, dim=-1).indices, True
        )
        return chosen.unsqueeze(1) if mask is None else mask & chosen.unsqueeze(1)

    def _scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[n, t, s]: each query's weighted sum over the heads of relu(q_h . k / sqrt(d)); keys [n,
        1, d, s]."""
        scores = F.relu(torch.matmul(q.float(), keys) * self.head_dim**-0.5)  # [n, heads, t, s]
        return torch.matmul(weights[:, 0].unsqueeze(-2), scores.transpose(1, 2)).squeeze(-2)
