"""Inkling's attention (the "inkling_attention" kind): no rotation; each query's score for a key
carries a bias by their distance, which the query's own relative state (r, d_rel wide per head)
mixes from the layer's profiles ([d_rel, extent], zero at a distance of extent or more). Keys and
values pass residual short convolutions (k_sconv, v_sconv, model/residual_conv.py) before the
per-head RMS norms of queries and keys; scores are divided by the head width. Sliding layers
(layer_types "hybrid_sliding") use the swa_* head shapes and attend inside sliding_window_size,
which is also their extent; the others attend fully with rel_extent and, under log_scaling_n_floor,
have their queries and bias at position p multiplied by 1 + log_scaling_alpha * ln(max((p + 1) /
floor, 1)).

Settings are read from the normalised config (families/inkling.py). Tensor parallelism splits the
heads:
q, k, v and r by their heads' rows, the convolutions' channels with k and v, o by columns (reduced);
the profiles and the norms' scales are whole on every rank. The keys go through `step.attend` like
every attention's, with the relative states and query positions beside the queries, so the bias is
built over whichever keys a step attends (static or paged cache).
"""

from __future__ import annotations

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.model.norm import Norm
from ster_dist.model.residual_conv import ResidualConv
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import ColumnLinear, Replicated, RowLinear


class InklingAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        raw, hidden = cfg.raw, cfg.hidden_size
        sliding = raw["inkling_layer_types"][layer] == "hybrid_sliding"
        prefix = "swa_" if sliding else ""
        heads, kv = raw[f"{prefix}num_attention_heads"], raw[f"{prefix}num_key_value_heads"]
        d, d_rel = raw[f"{prefix}head_dim"], raw["d_rel"]
        self.window = raw["sliding_window_size"] if sliding else None
        self.extent = raw["sliding_window_size"] if sliding else raw["rel_extent"]
        floor = raw.get("log_scaling_n_floor")
        self.log_scaling = (
            (float(floor), float(raw["log_scaling_alpha"])) if floor and not sliding else None
        )
        (h0, h1), (k0, k1) = ctx.attention_heads(heads, kv)
        self.layer, self.head_dim = layer, d
        self.local_heads, self.local_kv = h1 - h0, k1 - k0
        self.kv_shape = ((self.local_kv, d), (self.local_kv, d))
        self.q = ColumnLinear(hidden, heads * d, ((h0 * d, h1 * d),), False)
        self.k = ColumnLinear(hidden, kv * d, ((k0 * d, k1 * d),), False)
        self.v = ColumnLinear(hidden, kv * d, ((k0 * d, k1 * d),), False)
        self.r = ColumnLinear(hidden, heads * d_rel, ((h0 * d_rel, h1 * d_rel),), False)
        self.o = RowLinear(heads * d, hidden, ctx, False, cols=(h0 * d, h1 * d))
        kernel = raw["conv_kernel_size"]
        self.k_sconv = ResidualConv(kv * d, kernel, (layer, "k_sconv"), (k0 * d, k1 * d))
        self.v_sconv = ResidualConv(kv * d, kernel, (layer, "v_sconv"), (k0 * d, k1 * d))
        self.q_norm = Norm(d, cfg.norm_eps, ctx=ctx)
        self.k_norm = Norm(d, cfg.norm_eps, ctx=ctx)
        self.rel = Replicated((d_rel, self.extent))  # the layer's bias-by-distance profiles

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.local_heads, self.head_dim)
        k = self.k_sconv(self.k(x), step).view(b, t, self.local_kv, self.head_dim)
        v = self.v_sconv(self.v(x), step).view(b, t, self.local_kv, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)
        r = self.r(x).view(b, t, self.local_heads, -1).transpose(1, 2)
        positions = step.positions.reshape(-1, 1, t, 1).expand(b, 1, t, 1)
        out = step.attend(self.layer, (q, r, positions), k, v, self.window, self._attend)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))

    def _attend(
        self,
        queries,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        key_pos: torch.Tensor,
    ) -> torch.Tensor:
        """queries: (q [n, heads, t, d], relative states [n, heads, t, d_rel], positions [n, 1, t,
        1])."""
        q, r, positions = queries
        distance = positions - key_pos[:, None, None, :]  # [n, 1, t, keys]
        # each query's bias at every distance below the extent
        profiles = torch.matmul(r, self.rel.weight)
        index = distance.clamp(0, self.extent - 1).expand(*profiles.shape[:3], -1)
        bias = profiles.gather(-1, index).masked_fill(
            (distance < 0) | (distance >= self.extent), 0.0
        )
        if self.log_scaling is not None:  # in f32, as Inkling scales
            floor, alpha = self.log_scaling
            tau = 1.0 + alpha * torch.log(((positions.float() + 1) / floor).clamp(min=1.0))
            q, bias = (q.float() * tau).to(q.dtype), (bias.float() * tau).to(bias.dtype)
        groups = self.local_heads // self.local_kv
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / self.head_dim) + bias.to(q.dtype)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
