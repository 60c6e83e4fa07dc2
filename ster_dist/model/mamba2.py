"""The Mamba-2 token mixer (Mamba2, Bamba, Nemotron-H's "M" layers), as Transformers' Mamba2Mixer
computes it: in_proj to z, x, B, C and dt; a causal depthwise conv1d and SiLU over x, B and C; the
SSD scan (layers/ssd_scan.py) with dt = clamp(softplus(dt + dt_bias)) and A = -exp(A_log); a gated
RMS norm (x * silu(z), statistics per group of intermediate / n_groups channels); out_proj.

Settings come from the normalised config under Bamba's names (each family's normalisation maps its
own): mamba_n_heads, mamba_d_head, mamba_d_state, mamba_n_groups, mamba_d_conv, mamba_expand,
mamba_conv_bias, mamba_proj_bias, mamba_hidden_act, time_step_limit, mamba_norm_eps (the gated
norm's epsilon; default the model's). Falcon-H1's mixer adds four, which no other family states:
mamba_out_proj_bias (out_proj's bias apart from in_proj's; default mamba_proj_bias), mamba_rms_norm
false (no gated norm: the scan's output times silu(z)), mamba_norm_before_gate (the norm before the
gate, norm(y) * silu(z); default false) and ssm_multipliers (five muP scales of in_proj's z, x, B, C
and dt rows, applied to its output in forward so the checkpoint's in_proj stays as stored).

Tensor parallelism splits as vLLM's MambaMixer2: heads (z, x, dt, A_log, D, dt_bias, the norm's
scale) and their groups (B, C) go to ranks together, so with at least as many groups as ranks each
rank holds whole groups. With fewer, every group is replicated on tp / n_groups ranks which split
its heads; the gated norm's statistics of a group then add up the shares of the ranks holding it
(one small all-reduce). The conv1d's channels follow x, B and C; out_proj is row-split.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.layers.causal_conv import causal_conv
from ster_dist.layers.ssd_scan import ssd_scan
from ster_dist.model.recurrent import RecurrentMixer
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ColumnLinear, RowLinear, ShardedModule


def _positive(raw: dict, key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refusal(
            f"invalid model config: {key} is {value!r}; a Mamba-2 layer needs a positive integer there"
        )
    return value


def _bound(value, unstated: float):
    """One bound of time_step_limit: null (or Infinity, which the config reader reads as null) is
    `unstated`;
    Transformers 5 writes infinities as {"__float__": "Infinity"}."""
    if value is None:
        return unstated
    if isinstance(value, dict) and isinstance(value.get("__float__"), str):
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _time_step_limit(raw: dict) -> tuple[float, float]:
    """(low, high) clamp of dt; an unstated bound is open."""
    stated = raw.get("time_step_limit")
    if stated is None:
        return 0.0, math.inf
    bounds = (
        (_bound(stated[0], 0.0), _bound(stated[1], math.inf))
        if isinstance(stated, (list, tuple)) and len(stated) == 2
        else (None, None)
    )
    if None in bounds or not 0.0 <= bounds[0] < bounds[1]:
        raise Refusal(
            f"invalid model config: time_step_limit {stated!r} is not two bounds 0 <= low < high; "
            "correct it"
        )
    return bounds


def _multipliers(stated) -> tuple[float, ...] | None:
    """ssm_multipliers: five numbers (z, x, B, C, dt), or None where unstated or all one."""
    if stated is None:
        return None
    if (
        not isinstance(stated, (list, tuple))
        or len(stated) != 5
        or not all(isinstance(m, (int, float)) and not isinstance(m, bool) for m in stated)
    ):
        raise Refusal(
            f"invalid model config: ssm_multipliers is {stated!r}; it must be five numbers (the scales of "
            "in_proj's z, x, B, C and dt rows); correct it or leave it out"
        )
    return None if all(m == 1 for m in stated) else tuple(float(m) for m in stated)


class Mamba2Settings:
    """The layer's sizes from the normalised config, checked once."""

    def __init__(self, cfg: ModelConfig):
        raw = cfg.raw
        self.heads = _positive(raw, "mamba_n_heads")
        self.head_dim = _positive(raw, "mamba_d_head")
        self.state = _positive(raw, "mamba_d_state")
        self.groups = _positive(raw, "mamba_n_groups", 1)
        self.kernel = _positive(raw, "mamba_d_conv", 4)
        self.conv_bias = bool(raw.get("mamba_conv_bias", True))
        self.proj_bias = bool(raw.get("mamba_proj_bias", False))
        self.dt_limit = _time_step_limit(raw)
        self.inner = self.heads * self.head_dim
        expand = raw.get("mamba_expand")
        if expand is not None and expand * cfg.hidden_size != self.inner:
            raise Refusal(
                f"invalid model config: mamba_n_heads x head dim ({self.heads} x {self.head_dim}) differs "
                f"from expand x hidden_size ({expand} x {cfg.hidden_size}); correct the head count or size"
            )
        if self.heads % self.groups:
            raise Refusal(
                f"invalid model config: {self.heads} Mamba-2 heads do not split into n_groups "
                f"{self.groups} groups; n_groups must divide the head count"
            )
        self.out_bias = bool(raw.get("mamba_out_proj_bias", self.proj_bias))
        self.gated_norm = bool(raw.get("mamba_rms_norm", True))
        self.norm_before_gate = bool(raw.get("mamba_norm_before_gate", False))
        self.in_multipliers = _multipliers(raw.get("ssm_multipliers"))
        act = raw.get("mamba_hidden_act", "silu")
        if act != "silu":
            raise Refusal(
                f"invalid model config: the Mamba-2 activation {act!r} is not supported; only silu is"
            )


class Mamba2Shares:
    """This rank's heads [h0, h1) and groups [g0, g1) of one Mamba-2 layer, whole groups where there
    are enough (see the module docstring), else a share of one replicated group's heads."""

    def __init__(self, s: Mamba2Settings, ctx: ParallelCtx):
        tp, per_group = ctx.tp_size, s.heads // s.groups
        if s.groups >= tp:
            self.g0, self.g1 = ctx.split(s.groups)
            self.h0, self.h1 = self.g0 * per_group, self.g1 * per_group
            self.split_group = False
        else:
            if tp % s.groups or per_group < tp // s.groups:
                raise Refusal(
                    f"Mamba-2's {s.groups} groups of {per_group} heads cannot be shared by {tp} "
                    "tensor-parallel ranks; choose a --tp that divides or is a multiple of n_groups "
                    "and at most the heads"
                )
            ranks = tp // s.groups
            group, j = divmod(ctx.tp_rank, ranks)
            self.g0, self.g1 = group, group + 1
            self.h0 = group * per_group + j * per_group // ranks
            self.h1 = group * per_group + (j + 1) * per_group // ranks
            self.split_group = True
        self.heads, self.groups = self.h1 - self.h0, self.g1 - self.g0
        # each local head's group among the local groups
        self.head_group = torch.arange(self.h0, self.h1, device="cpu") // per_group - self.g0


class ConvWeights(ShardedModule):
    """The depthwise conv1d over x, B and C: weight [channels, 1, kernel] as stored, and its
    bias."""

    def __init__(self, channels: int, kernel: int, rows: tuple[tuple[int, int], ...], bias: bool):
        super().__init__()
        self._param("weight", Shard((channels, 1, kernel), 0, rows))
        if bias:
            self._param("bias", Shard((channels,), 0, rows))
        else:
            self.bias = None


class NormScale(ShardedModule):
    """The gated norm's scale, one per channel of x, split with the heads."""

    def __init__(self, inner: int, rows: tuple[int, int]):
        super().__init__()
        self._param("weight", Shard((inner,), 0, (rows,)))


class Mamba2Mixer(RecurrentMixer, ShardedModule):
    """One Mamba-2 layer on this rank's heads; A_log, D and dt_bias (one number per head) are its
    own."""

    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        s = self.settings = Mamba2Settings(cfg)
        sh = self.shares = Mamba2Shares(s, ctx)
        # the gated norm's epsilon: the model's, unless the family fixes its own (Zamba2's 1e-5)
        self.layer, self.ctx, self.eps = (
            layer,
            ctx,
            float(cfg.raw.get("mamba_norm_eps") or cfg.norm_eps),
        )
        inner, gn, p, n = s.inner, s.groups * s.state, s.head_dim, s.state
        x_rows = (sh.h0 * p, sh.h1 * p)
        bs, cs = (sh.g0 * n, sh.g1 * n), (gn + sh.g0 * n, gn + sh.g1 * n)
        # in_proj's rows: z [inner], x [inner], B [groups * state], C [groups * state], dt [heads]
        conv_rows = (x_rows, (inner + bs[0], inner + bs[1]), (inner + cs[0], inner + cs[1]))
        dt_rows = (2 * inner + 2 * gn + sh.h0, 2 * inner + 2 * gn + sh.h1)
        self.in_proj = ColumnLinear(
            cfg.hidden_size,
            2 * inner + 2 * gn + s.heads,
            (x_rows,) + tuple((inner + a, inner + b) for a, b in conv_rows) + (dt_rows,),
            s.proj_bias,
        )
        self.conv1d = ConvWeights(inner + 2 * gn, s.kernel, conv_rows, s.conv_bias)
        for name in ("A_log", "D", "dt_bias"):
            self._param(name, Shard((s.heads,), 0, ((sh.h0, sh.h1),)))
        self.norm = NormScale(inner, x_rows) if s.gated_norm else None
        self.out_proj = RowLinear(inner, cfg.hidden_size, ctx, s.out_bias, cols=x_rows)
        self.local_inner, self.local_bc = sh.heads * p, sh.groups * n

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """(conv1d's last kernel - 1 inputs per local channel, the SSM state per local head)."""
        s, sh = self.settings, self.shares
        return (
            (self.local_inner + 2 * self.local_bc, s.kernel - 1),
            (sh.heads, s.head_dim, s.state),
        )

    def _scan(
        self, x: torch.Tensor, valid: torch.Tensor | None, state: tuple[torch.Tensor, torch.Tensor]
    ):
        s, sh = self.settings, self.shares
        n, t, _ = x.shape
        z, xbc, dt = self.in_proj(x).split(
            [self.local_inner, self.local_inner + 2 * self.local_bc, sh.heads], -1
        )
        # Falcon-H1's muP scales of in_proj's parts, this rank's rows of each
        if s.in_multipliers is not None:
            # in the activations' dtype, as Transformers holds them (a buffer cast with the model)
            mz, mx, mb, mc, mdt = (
                torch.tensor(m, dtype=x.dtype, device=x.device) for m in s.in_multipliers
            )
            xs, b, c = xbc.split([self.local_inner, self.local_bc, self.local_bc], -1)
            z, xbc, dt = z * mz, torch.cat([xs * mx, b * mb, c * mc], -1), dt * mdt
        xbc, conv_state = causal_conv(
            xbc, self.conv1d.weight.flatten(1), self.conv1d.bias, state[0], valid
        )
        xbc = F.silu(xbc).float()
        xs, b, c = xbc.split([self.local_inner, self.local_bc, self.local_bc], -1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*s.dt_limit)
        # padding: no input and no decay, so the state passes through unchanged
        if valid is not None:
            keep = valid.unsqueeze(-1).to(dt.dtype)
            dt, xs = dt * keep, xs * keep
        group = sh.head_group.to(x.device)  # B and C of each local head's group
        b, c = (part.view(n, t, sh.groups, s.state)[:, :, group] for part in (b, c))
        y, ssm_state = ssd_scan(
            xs.view(n, t, sh.heads, s.head_dim),
            dt,
            -torch.exp(self.A_log.float()),
            b,
            c,
            self.D.float(),
            state[1].float(),
        )
        y = self._gated_norm(y.reshape(n, t, -1), z)
        return self.out_proj(y.to(x.dtype)), (
            conv_state.to(state[0].dtype),
            ssm_state.to(state[1].dtype),
        )

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMS norm of y * silu(z) over each group of inner / n_groups channels, times the scale
        (or, as the settings say, y * silu(z) alone, or the norm of y times the scale, then times
        silu(z))."""
        s = self.settings
        gate = F.silu(z.float())
        if self.norm is None:
            return y * gate
        if s.norm_before_gate:
            return self._group_norm(y) * gate
        return self._group_norm(y * gate)

    def _group_norm(self, h: torch.Tensor) -> torch.Tensor:
        """RMS norm over each group of inner / n_groups channels, times the scale."""
        s, sh = self.settings, self.shares
        width = s.inner // s.groups
        # this rank holds part of one group: sum the group's squares over its ranks
        if sh.split_group:
            sums = h.new_zeros((*h.shape[:-1], s.groups))
            sums[..., sh.g0] = h.pow(2).sum(-1)
            sums = self.ctx.all_reduce(sums)[..., sh.g0 : sh.g1]
            h = h * torch.rsqrt(sums / width + self.eps)
        else:
            grouped = h.unflatten(-1, (sh.groups, width))
            h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(
                -2
            )
        return self.norm.weight.float() * h
