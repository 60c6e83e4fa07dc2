"""MiniMax Sparse Attention (minimax_m3_vl_text): grouped-query attention whose every query attends
only the blocks of keys its own small indexer chooses.

index_q makes index_n_heads index queries (index_head_dim wide), each choosing for a run of
num_attention_heads / index_n_heads consecutive query heads (Transformers' grouping, whatever the
key-value heads), index_k one index key they all share; both are normed per head (index_q_norm,
index_k_norm) and rotated like the layer's own heads. A key scores as the plain product of the two,
in f32 as Transformers computes it; a block of index_block_size keys scores as its best key the
query may see. Each query of a key-value group keeps its group's index_topk_blocks best blocks (the
group of its index head), its own block and the index_local_blocks - 1 blocks before it always among
them (their score made infinite), and attends every allowed key of those blocks. Blocks are counted
by key position, which equals the key's slot in an unpadded sequence (Transformers' count) and keeps
a left-padded row in a batch choosing as it does alone. While a sequence holds no more blocks than a
query keeps, the layer is dense.

The index key rides in the cache behind each key-value head's value (the value slot is
index_head_dim wider), so a step continued from a static or paged cache scores the same keys as the
whole read. Under tensor parallelism a rank holds the index heads its query heads read (neighbouring
ranks may share one) and index_k whole: each rank chooses the blocks of its own heads without an
exchange.
"""

from __future__ import annotations

from functools import partial

import torch

from ster_dist.config import ModelConfig
from ster_dist.model.attention import Attention
from ster_dist.model.norm import Norm
from ster_dist.model.rope import apply_rotary
from ster_dist.model.step import StepState
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import ColumnLinear


class BlockSparseAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__(cfg, layer, ctx)
        raw, hidden = cfg.raw, cfg.hidden_size
        self.index_dim, self.block = int(raw["index_head_dim"]), int(raw["index_block_size"])
        self.topk, self.local = int(raw["index_topk_blocks"]), int(raw["index_local_blocks"])
        (q0, q1), _ = ctx.attention_heads(cfg.heads(layer), cfg.kv_heads(layer))
        index_heads = int(raw["index_n_heads"])
        per = cfg.heads(layer) // index_heads  # query heads one index head chooses for
        g0, g1 = q0 // per, (q1 - 1) // per + 1
        self.local_index = g1 - g0
        # each local query head's index head, among the local ones
        self.index_of_head = tuple(h // per - g0 for h in range(q0, q1))
        d = self.index_dim
        self.index_q = ColumnLinear(hidden, index_heads * d, ((g0 * d, g1 * d),), False)
        self.index_k = ColumnLinear(hidden, d, ((0, d),), False)
        common = dict(eps=cfg.norm_eps, offset=cfg.norm_offset, scale_f32=cfg.norm_scale_f32)
        self.index_q_norm, self.index_k_norm = Norm(d, **common), Norm(d, **common)
        (key, (heads, width)) = self.kv_shape
        self.kv_shape = (key, (heads, width + d))

    def forward(self, x: torch.Tensor, pos: StepState) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v, gate = self._project(x, pos)
        index_q = self.index_q_norm(
            self.index_q(x).view(b, t, self.local_index, self.index_dim)
        ).transpose(1, 2)
        index_k = self.index_k_norm(self.index_k(x)).unsqueeze(1)  # [b, 1, t, index_dim]
        if self.rope is not None:
            cos, sin = pos.rotary(self.rope, q.dtype)
            index_q = apply_rotary(index_q, cos, sin, self.rope.interleaved)
            index_k = apply_rotary(index_k, cos, sin, self.rope.interleaved)
        v = torch.cat((v, index_k.to(v.dtype).expand(-1, self.local_kv, -1, -1)), dim=-1)
        # each query's position rides with it ([b, 1, t, 1]), so a paged step's groups take theirs
        queries = (q, index_q, pos.positions.view(b, 1, t, 1))
        attend = partial(self._attend_blocks, pos.key_reach)
        out = pos.attend(self.layer, queries, k, v, self.window, attend, self.chunk)
        return self._output(out, gate)

    def _attend_blocks(
        self, reach: int, queries, k, v, mask: torch.Tensor | None, key_pos: torch.Tensor
    ) -> torch.Tensor:
        q, index_q, query_pos = queries
        v, index_k = v.split([self.value_dim, self.index_dim], dim=-1)
        keep = self.choose(index_q, index_k[:, :1], mask, query_pos[:, 0, :, 0], key_pos, reach)
        return self._attend_at(q, k, v, keep, key_pos)

    def choose(
        self,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
        mask: torch.Tensor | None,
        query_pos: torch.Tensor,
        key_pos: torch.Tensor,
        reach: int,
    ) -> torch.Tensor:
        """[b, local heads, t, s]: the allowed pairs (`mask` [b, 1, t, s], None for all) narrowed to
        the keys of the blocks each query's index head keeps. index_q [b, groups, t, d], index_k [b,
        1, s, d], query_pos [b, t], key_pos [b, s]; reach: one past the largest key position (the
        step's key_reach, known on the host)."""
        b, groups, t, _ = index_q.shape
        s = index_k.shape[2]
        allowed = (
            mask
            if mask is not None
            else torch.ones((b, 1, t, s), dtype=torch.bool, device=index_q.device)
        )
        # [b, groups, t, s]
        scores = torch.matmul(index_q.float(), index_k.float().transpose(-1, -2))
        scores = scores.masked_fill(~allowed, float("-inf"))
        # a padding slot's key is never allowed: any block will do
        blocks = key_pos.clamp(min=0) // self.block
        # blocks past the last key's get no score and are never kept: a count from the host's reach,
        # which may
        # exceed this call's keys, picks the same blocks as the keys' own largest would
        count = (reach - 1) // self.block + 1
        by_key = blocks[:, None, None, :].expand(b, groups, t, s)
        best = scores.new_full((b, groups, t, count), float("-inf")).scatter_reduce(
            -1, by_key, scores, "amax"
        )
        own = query_pos // self.block
        for back in range(self.local):  # the query's own block and those before it always win
            best.scatter_(
                -1,
                (own - back).clamp(min=0)[:, None, :, None].expand(b, groups, t, 1),
                float("inf"),
            )
        top = best.topk(min(self.topk, count), dim=-1)
        # a block no allowed key reaches keeps -inf and is not kept; it lands in a spare column
        # dropped after
        kept = torch.zeros((b, groups, t, count + 1), dtype=torch.bool, device=best.device)
        kept.scatter_(-1, top.indices.masked_fill(top.values == float("-inf"), count), True)
        keep = kept[..., :count].gather(-1, by_key)
        return keep[:, list(self.index_of_head)] & allowed
