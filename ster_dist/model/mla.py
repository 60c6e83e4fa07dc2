"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) over this rank's heads, and its cache.

The query comes from q_a_proj -> q_a_layernorm -> q_b_proj (or one q_proj without a query rank).
kv_a_proj_with_mqa yields a kv_lora_rank-wide latent and a qk_rope_head_dim-wide key part shared by
every head; the latent passes kv_a_layernorm and kv_b_proj, which yields each head's position-free
key part and its value. Only the shared part and each query's last qk_rope_head_dim channels rotate
(adjacent pairs for DeepSeek, halves for MiniCPM3). Mistral Large 3 multiplies every query by Llama
4's temperature at its absolute position. Ling 3.0 gates each head's output by sigmoid(g_proj(x))
(one number a head, split with the heads); HY V4 every output channel by sigmoid(linear_gate(x)),
and adds a learned sink logit per head to every softmax (its share dropped). LongCat-Flash
multiplies the query and the normed latent by sqrt(hidden_size / rank) of their bottlenecks.
DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa, hy_v4) narrows each query's keys to those its
indexer chooses (model/indexer.py); "shared" layers have no indexer and reuse the choice of the last
layer that has one, handed on through the step.

Under tensor parallelism the heads are split: q_b_proj (or q_proj) and kv_b_proj
by their head rows, o_proj by its columns; the latent projections and norms are
small and held whole. The cache keeps the normed latent and the rotated shared
key part, not per-head keys and values: (kv_lora_rank + qk_rope_head_dim) numbers
per token instead of heads * (qk + v), the memory saving MLA exists for.

A decode step (one new token) never expands the cached latents: kv_b_proj's key
half is absorbed into the query and its value half applied after attending, so a
step costs heads * slots * kv_lora_rank instead of slots * kv_lora_rank * heads *
(qk_nope + v) (DeepSeek's own inference form; equal up to rounding).

Dots3-Note's layers (its normalisation states the switches in the config) differ per layer: sliding
layers have their own sizes (ModelConfig.mla_of), heads and scale and attend within their window;
every layer norms the shared key part before it rotates (k_rope_norm), scales both normed latents by
sqrt(hidden / rank) (mla_lora_rescale; the indexer reads the scaled query latent) and norms its
latents with the config's epsilon.

A layer with an indexer caches the indexer's key (index_head_dim wide, whole on every rank;
GLM-5-Next's pooled indexer also its gate logits, model/pooled_indexer.py) after the shared rotated
key part in its value slot: both caches keep it without a store of their own, in the same blocks.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.model.attention import HeadScalars
from ster_dist.model.indexer import Indexer
from ster_dist.model.norm import Norm
from ster_dist.model.pooled_indexer import PooledIndexer
from ster_dist.model.rope import apply_rotary
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import ColumnLinear, FusedColumns, RowLinear

# DeepSeek's and MiniCPM3's latent norms keep their default epsilon, not the config's
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        m, hidden, heads = cfg.mla_of(layer), cfg.hidden_size, cfg.heads(layer)
        (h0, h1), _ = ctx.attention_heads(heads, heads)
        raw = cfg.raw
        latent_eps = raw.get("latent_norm_eps", LATENT_NORM_EPS)
        self.layer, self.local_heads = layer, h1 - h0
        self.nope, self.rope_dim, self.v_dim, self.rank = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        )
        qk = self.nope + self.rope_dim
        if m.q_lora_rank:
            self.q_a = ColumnLinear(hidden, m.q_lora_rank, ((0, m.q_lora_rank),), cfg.qkv_bias)
            self.q_a_norm = Norm(m.q_lora_rank, latent_eps)
            self.q_b = ColumnLinear(m.q_lora_rank, heads * qk, ((h0 * qk, h1 * qk),), False)
            self.q = None
        else:
            self.q_a = self.q_a_norm = self.q_b = None
            self.q = ColumnLinear(hidden, heads * qk, ((h0 * qk, h1 * qk),), False)
        width = self.rank + self.rope_dim
        self.kv_a = ColumnLinear(hidden, width, ((0, width),), cfg.qkv_bias)
        self.kv_a_norm = Norm(self.rank, latent_eps)
        # the query's first projection and the latent's read the same input: one product once loaded
        self.q_kv = FusedColumns(self.q_a if self.q_a is not None else self.q, self.kv_a)
        per_head = self.nope + self.v_dim
        self.kv_b = ColumnLinear(
            self.rank, heads * per_head, ((h0 * per_head, h1 * per_head),), False
        )
        self.o = RowLinear(
            heads * self.v_dim, hidden, ctx, cfg.o_bias, cols=(h0 * self.v_dim, h1 * self.v_dim)
        )
        # Ling 3.0 (its normalisation sets mla_head_gate): each head's output times
        # sigmoid(g_proj(x)), one a head
        self.head_gate = (
            ColumnLinear(hidden, heads, ((h0, h1),), False)
            if cfg.raw.get("mla_head_gate")
            else None
        )
        # HY V4's gated MLA (mla_output_gate): every output channel times sigmoid(linear_gate(x)),
        # before o_proj
        v_rows = (h0 * self.v_dim, h1 * self.v_dim)
        self.gate = (
            ColumnLinear(hidden, heads * self.v_dim, (v_rows,), False)
            if cfg.raw.get("mla_output_gate")
            else None
        )
        # HY V4: a learned sink logit per head joins every softmax, its share dropped
        self.sinks = HeadScalars(heads, (h0, h1)) if cfg.sinks(layer) else None
        # Dots3-Note: the shared key part normed before it rotates
        self.k_rope_norm = Norm(self.rope_dim, cfg.norm_eps) if raw.get("k_rope_norm") else None
        # both bottlenecks' normed outputs times sqrt(hidden / their rank): LongCat-Flash
        # (mla_scale_q_lora,
        # mla_scale_kv_lora) and Dots3-Note (mla_lora_rescale, both); the indexer reads the scaled
        # query latent
        both = bool(raw.get("mla_lora_rescale"))
        self.q_lora_scale = (
            (hidden / m.q_lora_rank) ** 0.5
            if (both or raw.get("mla_scale_q_lora")) and m.q_lora_rank
            else 1.0
        )
        self.kv_lora_scale = (
            (hidden / self.rank) ** 0.5 if both or raw.get("mla_scale_kv_lora") else 1.0
        )
        self.rope, self.window = cfg.layer_rope[layer], cfg.layer_window[layer]
        # a layer of its own sizes scores over its own head width (the model's scale carries any
        # YaRN factor)
        self.scale = cfg.attn_scale * (
            (cfg.head_dim / qk) ** 0.5 if cfg.mla and qk != cfg.head_dim else 1.0
        )
        # Llama 4's query temperature (Mistral Large 3): every query channel times 1 + beta ln(1 +
        # floor(p / length))
        self.temperature = (cfg.query_temperature_beta, cfg.query_temperature_length)
        # DeepSeek Sparse Attention: this layer's own indexer, or (GLM-DSA's "shared" layers) the
        # last one's choice
        kinds = cfg.raw.get("indexer_types")
        # GLM-5-Next chooses whole pools of keys
        pooled = PooledIndexer if raw.get("index_kpool") else Indexer
        self.indexer = pooled(cfg) if kinds and kinds[layer] == "full" else None
        self.shares_choice = bool(kinds) and kinds[layer] == "shared"
        # the cache keeps the normed latent (as the key) and the rotated key part every head shares
        # (as the value, followed by the indexer's key where there is one): one shared "head" each
        self.kv_shape = (
            (1, self.rank),
            (1, self.rope_dim + (self.indexer.cache_width if self.indexer else 0)),
        )

    def forward(self, x: torch.Tensor, pos) -> torch.Tensor:
        b, t, _ = x.shape
        q, kv = self.q_kv(x)
        q_latent = self.q_a_norm(q) if self.q is None else None
        if self.q_lora_scale != 1.0:
            q_latent = q_latent * self.q_lora_scale
        q = q if self.q is not None else self.q_b(q_latent)
        q = q.view(b, t, self.local_heads, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = kv.split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent).unsqueeze(1)  # [b, 1, t, rank]
        if self.kv_lora_scale != 1.0:
            latent = latent * self.kv_lora_scale
        k_rot = k_rot.unsqueeze(1)  # [b, 1, t, rope]: one key part for every head
        if self.k_rope_norm is not None:
            k_rot = self.k_rope_norm(k_rot)
        cos = sin = None
        if self.rope is not None:
            cos, sin = pos.rotary(self.rope, q.dtype)
            q_rot = apply_rotary(q_rot, cos, sin, self.rope.interleaved)
            k_rot = apply_rotary(k_rot, cos, sin, self.rope.interleaved)
        if self.temperature[0]:
            # absolute positions: a cached step scales as the whole read does
            beta, length = self.temperature
            scale = (1 + beta * torch.log(1 + torch.floor(pos.positions.float() / length)))[
                :, None, :, None
            ]
            q_nope, q_rot = q_nope * scale.to(q.dtype), q_rot * scale.to(q.dtype)
        queries = (q_nope, q_rot)
        if self.indexer is not None:
            index_queries, index_keys = self.indexer.project(x, q_latent, cos, sin)
            queries, k_rot = (
                queries + (index_queries,),
                torch.cat((k_rot, index_keys.to(k_rot.dtype)), dim=-1),
            )
        out = pos.attend(
            self.layer, queries, latent, k_rot, self.window, partial(self._attend_latent, pos)
        )
        if self.head_gate is not None:  # the gate in f32, as Transformers computes it
            out = out * torch.sigmoid(self.head_gate(x).float()).to(out.dtype).transpose(
                1, 2
            ).unsqueeze(-1)
        out = out.transpose(1, 2)
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(x)).view(b, t, self.local_heads, self.v_dim)
        return self.o(out.reshape(b, t, -1))

    def _attend_latent(self, pos, q, latent, k_rot, mask, key_pos) -> torch.Tensor:
        """[b, heads, t, v_head_dim]: one-token steps in the latent space (no per-key expansion),
        longer ones with each key's heads expanded from the latent."""
        q_nope, q_rot = q[:2]
        if self.indexer is not None:
            k_rot, index_keys = k_rot.split([self.rope_dim, self.indexer.cache_width], dim=-1)
            mask = self.indexer.choose(q[2], index_keys, mask, key_pos)
            # a step's key positions are one tensor per group of sequences: the choice's key for
            # later layers
            pos.handed_on[("dsa_choice", id(key_pos))] = mask
        elif self.shares_choice:
            mask = pos.handed_on[("dsa_choice", id(key_pos))]
        b, _, t, _ = q_nope.shape
        if t == 1 and latent.shape[2] > 1:
            return self._absorbed(q_nope, q_rot, latent, k_rot, mask)
        s = latent.shape[2]
        kv = (
            self.kv_b(latent.squeeze(1))
            .view(b, s, self.local_heads, self.nope + self.v_dim)
            .transpose(1, 2)
        )
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.local_heads, -1, -1)), dim=-1)
        query = torch.cat((q_nope, q_rot), dim=-1)
        if self.sinks is None:
            return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=self.scale)
        probs = self._probs(torch.matmul(query, k.transpose(-1, -2)) * self.scale, mask)
        return torch.matmul(probs.to(v.dtype), v)

    def latent_terms(self) -> tuple | None:
        """(scale, kv_b's key half [heads, nope, rank], its value half [heads, v, rank], sinks or
        None) where the Triton MLA decode (model/triton_attend.py) may attend in this layer's place:
        no indexer choosing keys."""
        if self.indexer is not None or self.shares_choice:
            return None
        w = self.kv_b.plain().view(self.local_heads, self.nope + self.v_dim, self.rank)
        return (
            self.scale,
            w[:, : self.nope],
            w[:, self.nope :],
            None if self.sinks is None else self.sinks.weight,
        )

    def _absorbed(self, q_nope, q_rot, latent, k_rot, mask) -> torch.Tensor:
        """Attention in the latent space: [b, heads, t, v_head_dim] without per-slot keys or
        values."""
        w = self.kv_b.plain().view(self.local_heads, self.nope + self.v_dim, self.rank)
        w_key, w_value = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_key)
        scores = (
            torch.einsum("bhtr,bsr->bhts", q_latent, latent[:, 0])
            + torch.einsum("bhtd,bsd->bhts", q_rot, k_rot[:, 0])
        ) * self.scale
        probs = self._probs(scores, mask).to(latent.dtype)
        return torch.einsum(
            "bhtr,hvr->bhtv", torch.einsum("bhts,bsr->bhtr", probs, latent[:, 0]), w_value
        )

    def _probs(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The softmax over each query's allowed keys in f32, with the head's sink logit beside them
        when it has one (its share dropped)."""
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            return torch.softmax(scores.float(), dim=-1)
        sink = self.sinks.weight.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat((scores.float(), sink), dim=-1), dim=-1)[..., :-1]
