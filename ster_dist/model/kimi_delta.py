"""Kimi delta attention (Kimi-Linear's KDA layers), a recurrent token mixer.

Qwen3-Next's gated delta rule (model/gated_delta.py) with three differences: query, key and value
come from separate q_proj, k_proj and v_proj, each through its own depthwise causal convolution
(q_conv1d, k_conv1d, v_conv1d) and SiLU; the state decays per key channel, g = -exp(A_log) *
softplus(f_b_proj(f_a_proj(x)) + dt_bias), A_log one number per head and dt_bias one per channel;
and the read-out is RMS-normalised per head (o_norm) and gated by sigmoid(g_b_proj(g_a_proj(x)))
before o_proj. Every head has its own key, value and state (num_heads of head_dim each); the write
strength is sigmoid(b_proj(x)).

GLM-5-Next keeps the narrow pairs but stores A_log [heads] (kda_a_log_per_head) and bounds the decay
as below (kda_safe_gate). Ling 3.0 (bailing_hybrid; its normalisation sets kda_full_rank_gates)
differs in three ways: the decay and the output gate come from one full-width projection each
(f_proj, g_proj) instead of a narrow pair; A_log is stored [heads]; and under kda_safe_gate the
decay is bounded, g = kda_lower_bound * sigmoid(exp(A_log) * (f
+ dt_bias)).

Tensor parallelism splits the heads as vLLM does: q/k/v, f_b, g_b and b projections are column
shares by head, each convolution its own channels, dt_bias its heads' entries, o_proj its columns
(the one reduction); the narrow f_a and g_a projections, the norm's scale and A_log (a number a
head) are held whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.layers.activation import activation
from ster_dist.layers.causal_conv import causal_conv
from ster_dist.model.gated_delta import gated_delta_rule
from ster_dist.model.recurrent import RecurrentMixer
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ColumnLinear, FusedColumns, RowLinear, ShardedModule

# the family's normalisation (families/kimi.py) reads them from linear_attn_config under
# Transformers' names
SIZE_KEYS = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")


def kda_sizes(raw: dict, path: str = "config.json") -> tuple[int, int, int]:
    """(heads, head width, convolution kernel), checked."""
    values = []
    for key in SIZE_KEYS:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise Refusal(
                f"invalid model config {path}: {key} is {value!r}; Kimi delta attention needs it as a "
                "positive integer (linear_attn_config's num_heads, head_dim, short_conv_kernel_size)"
            )
        values.append(value)
    return tuple(values)


def _lower_bound(raw: dict) -> float:
    bound = raw.get("kda_lower_bound", -5.0)
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound < 0:
        raise Refusal(
            f"invalid model config: kda_lower_bound is {bound!r}; the bounded decay needs a negative "
            "number (Ling 3.0's default is -5.0)"
        )
    return float(bound)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # as FLA's KDA kernels and Transformers compute it: x / sqrt(sum x^2 + eps)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class KimiDeltaAttention(RecurrentMixer, ShardedModule):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        heads, dk, kernel = kda_sizes(cfg.raw)
        if heads < ctx.tp_size:
            raise Refusal(
                f"the Kimi delta attention layers have {heads} heads, fewer than the {ctx.tp_size} "
                "tensor-parallel ranks; each rank needs a whole head: lower --tp"
            )
        hidden, width = cfg.hidden_size, heads * dk
        h0, h1 = ctx.split(heads)
        self.layer, self.head_dim, self.kernel, self.local_heads = layer, dk, kernel, h1 - h0
        rows = ((h0 * dk, h1 * dk),)
        self.q = ColumnLinear(hidden, width, rows, False)
        self.k = ColumnLinear(hidden, width, rows, False)
        self.v = ColumnLinear(hidden, width, rows, False)
        self.qkv = FusedColumns(self.q, self.k, self.v)  # one product once loaded
        for name in ("q_conv", "k_conv", "v_conv"):
            self._param(name, Shard((width, 1, kernel), 0, rows))
        self.full_rank = bool(cfg.raw.get("kda_full_rank_gates"))
        if self.full_rank:  # Ling 3.0
            self.f = ColumnLinear(hidden, width, rows, False)
            self.g = ColumnLinear(hidden, width, rows, False)
            self._param("A_log", Shard((heads,), 0, ((h0, h1),)))
            self.bound = _lower_bound(cfg.raw) if cfg.raw.get("kda_safe_gate", True) else None
        else:
            # the decay's narrow first projection, whole
            self.f_a = ColumnLinear(hidden, dk, ((0, dk),), False)
            self.f_b = ColumnLinear(dk, width, rows, False)
            # the output gate's narrow first projection
            self.g_a = ColumnLinear(hidden, dk, ((0, dk),), False)
            self.g_b = ColumnLinear(dk, width, rows, False)
            # stored [1, 1, heads, 1] (Kimi-Linear): one number a head, read whole (the loader
            # windows a tensor's
            # first dim only); GLM-5-Next stores it [heads] (kda_a_log_per_head) and bounds the
            # decay (kda_safe_gate)
            if cfg.raw.get("kda_a_log_per_head"):
                self._param("A_log", Shard((heads,), 0, ((h0, h1),)))
            else:
                self._param("A_log", Shard((1, 1, heads, 1)))
            self.bound = _lower_bound(cfg.raw) if cfg.raw.get("kda_safe_gate", False) else None
        self.heads = (h0, h1)
        self._param("dt_bias", Shard((width,), 0, rows))
        self.b = ColumnLinear(hidden, heads, ((h0, h1),), False)  # write strength
        self._param("norm_weight", Shard((dk,)))  # one scale for every head's read-out
        self.out = RowLinear(width, hidden, ctx, False, cols=rows[0])
        self.eps = cfg.norm_eps
        self.act = activation(cfg.hidden_act)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (
            (3 * self.local_heads * self.head_dim, self.kernel - 1),
            (self.local_heads, self.head_dim, self.head_dim),
        )

    def _scan(self, x: torch.Tensor, valid: torch.Tensor | None, state: tuple[torch.Tensor, ...]):
        conv_state, recurrent = state
        n, t, _ = x.shape
        if valid is not None:  # left padding reads as nothing, as Transformers masks it
            x = x * valid.unsqueeze(-1).to(x.dtype)
        # the three convolutions are independent channels: run them as one over query, key, then
        # value
        mixed = torch.cat(self.qkv(x), dim=-1)
        weight = torch.cat([self.q_conv, self.k_conv, self.v_conv])[:, 0]
        mixed, conv_state = causal_conv(mixed, weight, None, conv_state, valid)
        q, k, v = (
            part.view(n, t, -1, self.head_dim).float() for part in self.act(mixed).chunk(3, dim=-1)
        )
        q = l2norm(q) * self.head_dim**-0.5
        k = l2norm(k)
        beta = self.b(x).float().sigmoid()
        g = self._decay(x).view(n, t, -1, self.head_dim)
        if valid is not None:  # padding leaves the state as it was: no decay, no write
            keep = valid.unsqueeze(-1)
            beta, g = beta * keep, g * keep.unsqueeze(-1)
        y, recurrent = gated_delta_rule(q, k, v, g, beta, recurrent.float())
        gate = (self.g(x) if self.full_rank else self.g_b(self.g_a(x))).view(
            n, t, -1, self.head_dim
        )
        y = self._gated_norm(y.to(x.dtype), gate)
        return self.out(y.reshape(n, t, -1)), (conv_state, recurrent.to(state[1].dtype))

    def _decay(self, x: torch.Tensor) -> torch.Tensor:
        """The log decay of every key channel, [n, t, local heads, head_dim], in f32."""
        n, t, _ = x.shape
        if self.full_rank:
            rate = self.A_log.float().exp().view(1, 1, -1, 1)
            decay_in = (self.f(x).float() + self.dt_bias.float()).view(n, t, -1, self.head_dim)
            if self.bound is not None:
                return self.bound * torch.sigmoid(rate * decay_in)
            return -rate * F.softplus(decay_in)
        decay_in = (self.f_b(self.f_a(x)).float() + self.dt_bias.float()).view(
            n, t, -1, self.head_dim
        )
        a_log = self.A_log.float().view(-1)
        if a_log.numel() != self.local_heads:  # the [1, 1, heads, 1] form is held whole
            a_log = a_log[self.heads[0] : self.heads[1]]
        rate = a_log.view(1, 1, -1, 1).exp()
        if self.bound is not None:
            return self.bound * torch.sigmoid(rate * decay_in)
        return -rate * F.softplus(decay_in)

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # Transformers' KimiLinearRMSNormGated: normalise, scale and gate by sigmoid all in f32
        h = y.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm_weight.float() * h
        return (h * gate.float().sigmoid()).to(y.dtype)
