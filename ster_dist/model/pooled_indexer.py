"""GLM-5-Next's pooled indexer: DeepSeek Sparse Attention choosing whole pools of keys instead of
single keys.

Every index_kpool consecutive positions (from a sequence's first token) form one pool. A pool's key
is the softmax-weighted sum of its tokens' indexer keys, the weights per channel
softmax(index_kpool_compress_gate . x
+ index_kpool_compress_ape[offset in the pool]) over the pool's tokens. A query scores every pool
that has closed at or before it as model/indexer.py scores single keys (sum_h weight_h * relu(q_h .
key / sqrt(d)), in f32) and keeps its index_topk / index_kpool best; under
index_kpool_always_select_tail it also sees every key of its own unfinished pool. The layer then
attends those keys only. With qk_rope_head_dim 0 nothing rotates here.

Each token's indexer key and its gate logits ride in the latent attention's cache slot
(model/mla.py), so both caches keep them and the pools are rebuilt from them at every step: a decode
step chooses as the whole read does. Pools follow key positions, so the static cache's left padding
and the paged cache's unused slots (positions no query has reached) never join one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import ModelConfig
from ster_dist.model.indexer import Indexer
from ster_dist.parallel.linear import Replicated


class PooledIndexer(Indexer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        raw = cfg.raw
        self.pool, self.with_tail = (
            int(raw["index_kpool"]),
            bool(raw["index_kpool_always_select_tail"]),
        )
        self.compress_ape = Replicated((self.pool, self.head_dim))
        self.compress_gate = Replicated((self.head_dim, cfg.hidden_size))
        self.cache_width = 2 * self.head_dim  # the key, then its gate logits

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, cos, sin):
        queries, k = super().project(x, q_latent, cos, sin)
        gates = F.linear(x, self.compress_gate.weight).unsqueeze(1)
        return queries, torch.cat((k, gates.to(k.dtype)), dim=-1)

    def choose(
        self,
        queries,
        keys: torch.Tensor,
        mask: torch.Tensor | None,
        key_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The allowed pairs [n, 1, t, s] narrowed to the keys of each query's chosen pools and its
        tail."""
        q, weights = queries
        n, _, t, _ = q.shape
        s = keys.shape[2]
        if self.with_tail and -(-s // self.pool) <= self.topk // self.pool:
            # every closed pool is kept and the tail joins them: each query sees all it may
            return mask
        visible = (
            mask[:, 0]
            if mask is not None
            else torch.ones(n, t, s, dtype=torch.bool, device=q.device)
        )  # [n, t, s]
        real = visible[:, -1]  # the last query (a real token) sees every real key up to it
        span = int(key_pos.masked_fill(~real, 0).max()) + 1
        pools = -(-span // self.pool)
        slot_of = key_pos.clamp(0, pools * self.pool - 1).masked_fill(~real, pools * self.pool)
        # keys, gates and visibility laid out by position: [n, pools * pool (+1 for the dropped),
        # ...]
        width = pools * self.pool + 1
        by_pos = keys.new_zeros(n, width, 2 * self.head_dim)
        by_pos.scatter_(1, slot_of.unsqueeze(-1).expand(-1, -1, 2 * self.head_dim), keys[:, 0])
        member = torch.zeros(n, width, dtype=torch.bool, device=q.device).scatter_(1, slot_of, real)
        seen = torch.zeros(n, t, width, dtype=torch.bool, device=q.device)
        seen.scatter_(2, slot_of.unsqueeze(1).expand(-1, t, -1), visible & real.unsqueeze(1))
        by_pos, member, seen = by_pos[:, :-1], member[:, :-1], seen[:, :, :-1]
        pkey, pgate = by_pos.view(n, pools, self.pool, -1).split(self.head_dim, dim=-1)
        # in f32 as Transformers weighs them, the weighted sum in the keys' own dtype
        logits = (pgate.float() + self.compress_ape.weight.float()).masked_fill(
            ~member.view(n, pools, self.pool, 1), float("-inf")
        )
        # [n, pools, d]
        pool_keys = (torch.nan_to_num(logits.softmax(dim=2)).to(keys.dtype) * pkey).sum(dim=2)
        closed = seen.view(n, t, pools, self.pool).all(-1)  # [n, t, pools]
        scores = self._scores(q, weights, pool_keys.float().transpose(-1, -2).unsqueeze(1))
        scores = scores.masked_fill(~closed, float("-inf"))
        keep = min(self.topk // self.pool, pools)
        chosen = (
            torch.zeros_like(closed).scatter_(-1, scores.topk(keep, dim=-1).indices, True) & closed
        )
        pool_of = (slot_of // self.pool).clamp(max=pools - 1)  # [n, s]
        allowed = (
            chosen.gather(-1, pool_of.unsqueeze(1).expand(-1, t, -1)) & visible & real.unsqueeze(1)
        )
        if self.with_tail:
            in_closed = closed.gather(-1, pool_of.unsqueeze(1).expand(-1, t, -1))
            allowed |= visible & real.unsqueeze(1) & ~in_closed
        # a padding query (the static cache's) sees only itself, so its row stays finite
        allowed |= visible & ~real.unsqueeze(1)
        return allowed.unsqueeze(1)
