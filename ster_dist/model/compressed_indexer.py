"""DeepSeek-V4's Lightning Indexer: which compressed entries each query of a compressed sparse
attention layer sees.

It runs its own window compressor (model/window_compressor.py, two series, index_head_dim wide) over
the same windows as the layer's, and queries from the layer's query latent (q_b_proj, index_n_heads
heads, the trailing rotated channels turned at the query's position). A query scores every entry
whose window closed at or before it by sum_h w_h * relu(q_h . k) / sqrt(index_head_dim), w =
weights_proj(x) / sqrt(index_n_heads), in f32, and keeps its index_topk best. Held whole on every
rank (as vLLM replicates it): every rank chooses the same entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.model.window_compressor import WindowCompressor, rotate_tail
from ster_dist.parallel.linear import ColumnLinear


class CompressedIndexer(torch.nn.Module):
    def __init__(
        self, hidden: int, q_rank: int, heads: int, width: int, topk: int, rate: int, eps: float
    ):
        super().__init__()
        self.heads, self.width, self.topk = heads, width, topk
        self.compressor = WindowCompressor(hidden, width, rate, True, eps)
        self.q_b = ColumnLinear(q_rank, heads * width, ((0, heads * width),), False)
        self.weights_proj = ColumnLinear(hidden, heads, ((0, heads),), False)

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ):
        """(queries [b, heads, t, width] turned at their positions, head weights [b, 1, t, heads])
        in f32."""
        b, t, _ = x.shape
        q = rotate_tail(
            self.q_b(q_latent).view(b, t, self.heads, self.width).transpose(1, 2), cos, sin
        )
        weights = self.weights_proj(x).float() * self.heads**-0.5
        return q.float(), weights.unsqueeze(1)

    def choose(self, queries, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[n, t, entries] of the entries each query keeps: its index_topk best of those `visible`
        to it, from the indexer's entries keys [n, entries, width]."""
        q, weights = queries
        scores = (
            F.relu(torch.matmul(q, keys.float().transpose(-1, -2).unsqueeze(1))) * self.width**-0.5
        )
        # [n, t, entries]
        scores = (scores * weights[:, 0].transpose(1, 2).unsqueeze(-1)).sum(dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
        keep = min(self.topk, keys.shape[1])
        chosen = torch.zeros_like(visible).scatter_(-1, scores.topk(keep, dim=-1).indices, True)
        return chosen & visible
