"""Grouped-query attention over this rank's heads: q/k/v projections (column-parallel) with this
layer's own head counts and values as wide as the config says (Laguna, MiMo-V2-Flash), optional
query/key norms (before or after the rotation, with or without a scale, in the layers the config
marks), rotation, Llama 4's query temperature, clipping, value scaling, masks (causal, padding,
sliding window, chunks), soft-capping, learned sinks (GPT-OSS, MiMo-V2-Flash), ALiBi biases (BLOOM,
MPT, Falcon; Step1's by the square root of the distance), an output gate (Qwen3-Next's sigmoid,
Laguna's softplus, Step 3.5's sigmoid per head, K2-Horizon's silu or base-2 softplus), value experts
in place of the value projection (K2-Horizon's MoVA, model/value_experts.py), and the row-parallel
output projection.

A layer may norm each value head without a scale (Gemma 3n's and Gemma 4's value_norm), and may read
an earlier layer's keys and values rather than make its own (the shared layers of Gemma 3n and Gemma
4,
`layer_kv_source`): such a layer has no key or value projection and keeps nothing in the cache; the
step hands it the source layer's. Gemma 4's layers may also have heads of their own width
(`layer_head_dim`) and take their values from the key projection (`layer_value_from_key`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.model.norm import Norm
from ster_dist.model.rope import apply_rotary
from ster_dist.model.step import StepState
from ster_dist.model.value_experts import ValueExperts
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ColumnLinear, FusedColumns, RowLinear, ShardedModule


class HeadScalars(ShardedModule):
    """One number per attention head, split with the heads (GPT-OSS's sinks)."""

    def __init__(self, heads: int, rows: tuple[int, int]):
        super().__init__()
        self._param("weight", Shard((heads,), 0, (rows,)))


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's slope of every head, by global head index, as BLOOM computes them in f32 (MPT's are
    the same): 2^(-8i/n) for a power of two n, else those of the power below followed by every other
    one of the next."""
    closest = 2 ** math.floor(math.log2(heads))
    # the decoder is built under the meta device; these are numbers, never weights
    cpu = dict(device="cpu")
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32, **cpu)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32, **cpu))
    if closest != heads:
        extra = torch.tensor(
            2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32, **cpu
        )
        remaining = min(closest, heads - closest)
        slopes = torch.cat(
            [
                slopes,
                torch.pow(extra, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32, **cpu)),
            ]
        )
    return slopes.tolist()


def one_query_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Unmasked attention of one query per row [batch, heads, 1, width] over keys and values shared
    by groups of query heads [batch, kv heads, keys, width]: each group's queries read as rows of
    one query block over its key head, which is what enable_gqa computes. On a CPU in bf16 / f16,
    SDPA's grouped-query path costs about twice this for a decode step (60 against 100-130 us a
    layer on SmolLM2's shapes); in f32 it is the faster."""
    batch, heads, _, _ = q.shape
    out = F.scaled_dot_product_attention(
        q.reshape(batch, k.shape[1], heads // k.shape[1], q.shape[-1]), k, v, scale=scale
    )
    return out.reshape(batch, heads, 1, v.shape[-1])


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, ctx: ParallelCtx, in_features: int | None = None
    ):
        super().__init__()
        # Gemma 4's full layers have wider heads
        d, hidden = cfg.head_dim_of(layer), cfg.hidden_size
        # MiMo-V2-Flash's values are narrower than its queries and keys
        dv = cfg.value_head_dim or d
        # this layer's own counts where layers differ
        heads, kv_heads = cfg.heads(layer), cfg.kv_heads(layer)
        # what q, k and v read: Zamba2's shared block reads twice the hidden width
        width = in_features or hidden
        (h0, h1), (k0, k1) = ctx.attention_heads(heads, kv_heads)
        self.local_heads, self.local_kv = h1 - h0, k1 - k0
        self.head_dim, self.value_dim, self.layer = d, dv, layer
        # the earlier layer whose keys and values this one attends (None: its own), and whether a
        # later layer
        # reads this one's
        self.kv_source = cfg.layer_kv_source[layer] if cfg.layer_kv_source else None
        self.keeps_kv = layer in cfg.layer_kv_source
        own = self.kv_source is None
        # what one position keeps in the cache on this rank: (heads, width) of its key and of its
        # value
        self.kv_shape = ((self.local_kv, d), (self.local_kv, dv)) if own else None
        self.q = ColumnLinear(width, heads * d, ((h0 * d, h1 * d),), cfg.qkv_bias)
        self.k = (
            ColumnLinear(width, kv_heads * d, ((k0 * d, k1 * d),), cfg.qkv_bias) if own else None
        )
        # K2-Horizon's MoVA: on the layers with experts, value experts stand where the value
        # projection would
        mova = cfg.value_experts is not None and cfg.feed_forward(layer) == "moe"
        # Gemma 4's attention_k_eq_v: the value is the key projection before its norm
        self.value_from_key = (
            own and bool(cfg.layer_value_from_key) and cfg.layer_value_from_key[layer]
        )
        self.v = (
            ColumnLinear(width, kv_heads * dv, ((k0 * dv, k1 * dv),), cfg.qkv_bias)
            if own and not mova and not self.value_from_key
            else None
        )
        self.value_experts = (
            ValueExperts(cfg.value_experts, width, kv_heads * dv, (k0 * dv, k1 * dv))
            if mova
            else None
        )
        # a scale-free RMS norm over each value head (Gemma 3n, Gemma 4)
        self.v_norm = Norm(dv, eps=cfg.norm_eps, affine=False) if cfg.value_norm and own else None
        self.o = RowLinear(heads * dv, hidden, ctx, cfg.o_bias, cols=(h0 * dv, h1 * dv))
        self.value_scale = cfg.value_scale
        # Qwen3-Next's output gate: sigmoid(x W_gate^T) scales each head's output before o;
        # Laguna's: the
        # softplus of one logit per head (or per channel)
        self.softplus_gate, self.output_gate = cfg.softplus_gate, cfg.output_gate
        # Step 3.5: the sigmoid of one logit per head
        self.sigmoid_head_gate = cfg.sigmoid_head_gate
        if cfg.attn_output_gate or cfg.softplus_gate == "element" or cfg.output_gate != "none":
            self.gate = ColumnLinear(
                hidden, heads * dv, ((h0 * dv, h1 * dv),), cfg.qkv_bias and cfg.attn_output_gate
            )
        elif cfg.softplus_gate == "head" or cfg.sigmoid_head_gate:  # one logit per head
            self.gate = ColumnLinear(hidden, heads, ((h0, h1),), False)
        else:
            self.gate = None
        self.qkv = FusedColumns(self.q, self.k, self.v, self.gate)  # one product once loaded
        self.q_norm = self.k_norm = None
        if cfg.qk_norm != "none" and (not cfg.layer_qk_norm or cfg.layer_qk_norm[layer]):
            common = dict(
                eps=cfg.norm_eps,
                kind=cfg.qk_norm_kind,
                bias=cfg.qk_norm_bias,
                offset=cfg.norm_offset,
                affine=cfg.qk_norm_affine,
                ctx=ctx,
                scale_f32=cfg.norm_scale_f32,
            )
            if cfg.qk_norm == "head":
                per_head = cfg.qk_norm_per_head_weight
                self.q_norm = Norm(
                    d,
                    heads=heads if per_head else 1,
                    per_head_weight=per_head,
                    rows=((h0, h1),) if per_head else None,
                    **common,
                )
                self.k_norm = (
                    Norm(
                        d,
                        heads=kv_heads if per_head else 1,
                        per_head_weight=per_head,
                        rows=((k0, k1),) if per_head else None,
                        **common,
                    )
                    if own
                    else None
                )
            else:  # over the whole projection, split like it
                self.q_norm = Norm(heads * d, rows=((h0 * d, h1 * d),), **common)
                self.k_norm = Norm(kv_heads * d, rows=((k0 * d, k1 * d),), **common)
        self.per_head_norm = cfg.qk_norm == "head"
        self.norm_after_rope = cfg.qk_norm_after_rope
        tempered = not cfg.layer_query_temperature or cfg.layer_query_temperature[layer]
        self.temperature = (
            cfg.query_temperature_beta if tempered else 0.0,
            cfg.query_temperature_length,
            cfg.query_temperature_offset,
        )
        self.rope = cfg.layer_rope[layer]
        self.window = cfg.layer_window[layer]
        self.chunk = cfg.layer_chunk[layer] if cfg.layer_chunk else None
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_softcap
        self.clip = cfg.clip_qkv
        self.sinks = HeadScalars(heads, (h0, h1)) if cfg.sinks(layer) else None
        # ALiBi: this rank's heads' slopes (their global indices), kept as numbers so meta
        # construction has none
        self.alibi = tuple(alibi_slopes(cfg.num_heads)[h0:h1]) if cfg.alibi else None
        self.alibi_before_scale, self.alibi_bf16 = cfg.alibi_before_scale, cfg.alibi_bf16
        self.alibi_sqrt = cfg.alibi_sqrt

    def kernel_terms(self, fn) -> tuple[float, float] | None:
        """(scale, soft cap or 0) when `fn` (what this layer hands its step to attend with) is
        Attention's own softmax(cap tanh(q k^T scale / cap)) v over the keys its mask allows and
        nothing more (no sinks or position biases), so the decode and causal kernels may compute it
        in its place (model/step.py, model/paged_step.py); None otherwise."""
        own = (
            getattr(fn, "__func__", None) is Attention._attend_at
            and type(self)._attend is Attention._attend
        )
        plain = self.sinks is None and self.alibi is None and not self.alibi_sqrt
        return (self.scale, self.softcap or 0.0) if own and plain else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys, values and the output gate's logits (None without one) from the layer's
        input."""
        return tuple(self.qkv(x))

    def forward(self, x: torch.Tensor, pos: StepState) -> torch.Tensor:
        # Gemma 3n's shared layers: its own queries over its source's keys
        if self.kv_source is not None:
            q, gate = self._shared_queries(x, pos)
            out = pos.attend(
                self.kv_source, q, None, None, self.window, self._attend_at, self.chunk
            )
            return self._output(out, gate)
        q, k, v, gate = self._project(x, pos)
        # its bias depends on each query's own position: hand them with the queries
        if self.alibi_sqrt:
            b, _, t, _ = q.shape
            q = (q, pos.positions.reshape(-1, 1, t, 1).expand(b, 1, t, 1))
        out = pos.attend(
            self.layer, q, k, v, self.window, self._attend_at, self.chunk, keep=self.keeps_kv
        )
        return self._output(out, gate)

    def _project(self, x: torch.Tensor, pos: StepState):
        """(queries, keys, values [batch, heads, seq, width], the output gate's logits or None):
        projected, normed, clipped and rotated as the config says."""
        b, t, _ = x.shape
        q, k, v, gate = self.project(x)
        if self.value_experts is not None:
            v = self.value_experts(x)
        if self.value_from_key:
            v = k
        if self.q_norm is not None and not self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # OLMoE norms the whole projection, then clips
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        q = q.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.local_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.local_kv, self.value_dim).transpose(1, 2)
        if self.value_scale != 1.0:
            v = v * self.value_scale
        if self.v_norm is not None:
            v = self.v_norm(v)
        per_head = self.per_head_norm and self.q_norm is not None
        if per_head and not self.norm_after_rope:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        if self.rope is not None:
            cos, sin = pos.rotary(self.rope, q.dtype)
            q = apply_rotary(q, cos, sin, self.rope.interleaved)
            k = apply_rotary(k, cos, sin, self.rope.interleaved)
        if per_head and self.norm_after_rope:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        if self.temperature[0]:
            q = q * self._query_temperature(pos.positions).to(q.dtype)
        return q, k, v, gate

    def _shared_queries(
        self, x: torch.Tensor, pos: StepState
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A layer attending its source layer's keys and values: its own queries only, normed and
        rotated as the source's keys were, and the output gate's logits."""
        b, t, _ = x.shape
        q, _, _, gate = self.qkv(x)
        if self.q_norm is not None and not self.per_head_norm:
            q = self.q_norm(q)
        q = q.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.per_head_norm:
            q = self._head_norm(self.q_norm, q)
        if self.rope is not None:
            cos, sin = pos.rotary(self.rope, q.dtype)
            q = apply_rotary(q, cos, sin, self.rope.interleaved)
        return q, gate

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Attention's output [batch, heads, seq, width] gated as the config says, then
        projected."""
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, -1)
        if self.softplus_gate == "head":
            gate = F.softplus(gate.float()).to(out.dtype)
            out = (
                out.unflatten(-1, (self.local_heads, self.value_dim)) * gate.unsqueeze(-1)
            ).flatten(-2)
        elif self.sigmoid_head_gate:
            heads = out.unflatten(-1, (self.local_heads, self.value_dim))
            out = (heads * torch.sigmoid(gate).unsqueeze(-1)).flatten(-2)
        elif self.softplus_gate == "element":
            out = out * F.softplus(gate.float()).to(out.dtype)
        elif self.output_gate == "silu":
            out = out * F.silu(gate)
        elif self.output_gate == "softplus_ln2":  # log2(1 + 2^g): a softplus of slope ln 2
            out = out * F.softplus(gate.float(), beta=math.log(2)).to(out.dtype)
        elif gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o(out)

    def _attend_at(self, q, k, v, mask: torch.Tensor | None, key_pos: torch.Tensor) -> torch.Tensor:
        if self.alibi_sqrt:
            q, query_pos = q
            return self._attend(q, k, v, mask, self._alibi_sqrt(query_pos, key_pos))
        bias = self._alibi(key_pos) if self.alibi is not None else None
        return self._attend(q, k, v, mask, bias)

    def _alibi_sqrt(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """[batch, local heads, queries, keys]: -slope x sqrt(query position - key position)
        (Step1), from absolute positions, so a cached step adds what the whole read does. Keys after
        the query are masked; their distance is clamped only to keep the root finite."""
        slopes = torch.tensor(self.alibi, dtype=torch.float32, device=key_pos.device).view(
            1, -1, 1, 1
        )
        distance = (query_pos - key_pos[:, None, None, :]).clamp(min=0).float()
        return -slopes * torch.sqrt(distance)

    def _query_temperature(self, positions: torch.Tensor) -> torch.Tensor:
        # Llama 4's temperature from absolute positions, so a cached decode step scales as the whole
        # read does
        beta, length, offset = self.temperature
        scale = 1 + beta * torch.log(1 + torch.floor((positions.float() + offset) / length))
        return scale[:, None, :, None]

    def _alibi(self, key_pos: torch.Tensor) -> torch.Tensor:
        """[batch, local heads, 1, keys]: slope x absolute key position, so a cached step adds what
        the whole read does (a per-query offset would cancel in the softmax)."""
        slopes = torch.tensor(self.alibi, dtype=torch.float32, device=key_pos.device).view(
            1, -1, 1, 1
        )
        if self.alibi_bf16:  # Falcon builds slopes and bias in bf16
            bias = (slopes.bfloat16() * key_pos[:, None, None, :]).float()
        else:
            bias = slopes * key_pos[:, None, None, :].float()
        return bias * self.scale if self.alibi_before_scale else bias

    @staticmethod
    def _head_norm(norm: Norm, x: torch.Tensor) -> torch.Tensor:
        # [b, heads, t, d] -> norm over d with each head's own scale where it has one
        return (
            norm(x.transpose(1, 2).flatten(-2))
            .unflatten(-1, (x.shape[1], x.shape[3]))
            .transpose(1, 2)
        )

    def _attend(
        self, q, k, v, mask: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        groups = self.local_heads // self.local_kv
        if self.softcap is None and self.sinks is None and bias is None:
            if (
                groups > 1
                and mask is None
                and q.shape[2] == 1
                and q.dtype in (torch.bfloat16, torch.float16)
            ):
                return one_query_grouped(q, k, v, self.scale)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=groups > 1
            )
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        if self.sinks is not None:  # one more logit per head; its share of the softmax is dropped
            sink = (
                self.sinks.weight.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            )
            probs = torch.softmax(torch.cat((scores, sink), dim=-1).float(), dim=-1)[..., :-1]
            return torch.matmul(probs.to(q.dtype), v)
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
