"""The Mamba-1 token mixer (selective state space): Mamba, Falcon Mamba and Jamba's Mamba layers, as
Transformers' MambaMixer computes it on its torch path.

One sequence's state is the causal convolution's last kernel - 1 inputs [channels, kernel - 1] and
the scan's state [channels, state_size]. Every channel of the inner width runs its own recurrence,
so tensor parallelism splits the inner width by channel as vLLM's MambaMixer does: the input
projection's x and z halves are column-split, the convolution, dt_proj, A_log and D follow the
rank's channels, x_proj is row-split over them (dt, B and C are summed across ranks, every channel
needs them whole) and out_proj is row-split. Nothing else is exchanged.

Settings are read from the family's normalised config (cfg.raw), under Jamba's key names:
mamba_intermediate_size (the inner width), mamba_d_state, mamba_d_conv, mamba_dt_rank,
mamba_conv_bias, mamba_proj_bias, and mamba_dt_norm: "none", "weightless" (Falcon Mamba's RMS norms
of dt, B and C, at mixer_rms_eps) or "weighted" (Jamba's, at rms_norm_eps), with mamba_norm_eps
their epsilon.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.layers.activation import activation
from ster_dist.layers.causal_conv import causal_conv
from ster_dist.model.norm import Norm
from ster_dist.model.recurrent import RecurrentMixer
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ColumnLinear, RowLinear, ShardedModule

DT_NORMS = ("none", "weightless", "weighted")


def _count(raw: dict, key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refusal(
            f"invalid model config: {key} is {value!r}; Mamba layers need a positive whole number there"
        )
    return value


def _flag(raw: dict, key: str) -> bool:
    value = raw.get(key)
    if not isinstance(value, bool):
        raise Refusal(f"invalid model config: {key} is {value!r}; state true or false")
    return value


class MambaMixer(RecurrentMixer, ShardedModule):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        raw = cfg.raw
        self.layer, self.ctx = layer, ctx
        hidden = cfg.hidden_size
        inner = _count(raw, "mamba_intermediate_size")
        self.state_size = _count(raw, "mamba_d_state")
        self.kernel = _count(raw, "mamba_d_conv")
        self.dt_rank = _count(raw, "mamba_dt_rank")
        conv_bias, proj_bias = _flag(raw, "mamba_conv_bias"), _flag(raw, "mamba_proj_bias")
        dt_norm = raw.get("mamba_dt_norm", "none")
        if dt_norm not in DT_NORMS:
            raise Refusal(
                f"invalid model config: mamba_dt_norm is {dt_norm!r}; one of {', '.join(DT_NORMS)}"
            )
        if inner < ctx.tp_size:
            raise Refusal(
                f"the Mamba inner width {inner} is narrower than {ctx.tp_size} tensor-parallel ranks; "
                "lower --tp"
            )
        try:
            self.act = activation(cfg.hidden_act)
        except ValueError:
            raise Refusal(
                f"invalid model config: hidden_act {cfg.hidden_act!r} is not supported in Mamba "
                "layers"
            ) from None
        c0, c1 = ctx.split(inner)
        self.channels = c1 - c0
        rows = ((c0, c1),)
        self.in_x = ColumnLinear(hidden, inner, rows, proj_bias)
        self.in_z = ColumnLinear(hidden, inner, rows, proj_bias)
        # Transformers' Conv1d layout
        self._param("conv_weight", Shard((inner, 1, self.kernel), 0, rows))
        if conv_bias:
            self._param("conv_bias", Shard((inner,), 0, rows))
        else:
            self.conv_bias = None
        self.x_proj = RowLinear(
            inner, self.dt_rank + 2 * self.state_size, ctx, False, cols=(c0, c1)
        )
        self.dt_proj = ColumnLinear(self.dt_rank, inner, rows, True)
        self._param("A_log", Shard((inner, self.state_size), 0, rows))
        self._param("D", Shard((inner,), 0, rows))
        self.out_proj = RowLinear(inner, hidden, ctx, proj_bias, cols=(c0, c1))
        if dt_norm == "none":
            self.dt_norm = self.b_norm = self.c_norm = None
        else:
            eps = float(raw.get("mamba_norm_eps", 1e-6))
            affine = dt_norm == "weighted"
            self.dt_norm = Norm(self.dt_rank, eps, affine=affine)
            self.b_norm = Norm(self.state_size, eps, affine=affine)
            self.c_norm = Norm(self.state_size, eps, affine=affine)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.channels, self.kernel - 1), (self.channels, self.state_size)

    def _scan(
        self, x: torch.Tensor, valid: torch.Tensor | None, state: tuple[torch.Tensor, torch.Tensor]
    ):
        conv_state, ssm_state = state
        dtype = x.dtype
        mask = None if valid is None else valid.unsqueeze(-1).to(dtype)
        if mask is not None:
            x = x * mask
        xs, z = self.in_x(x), self.in_z(x)
        xs, conv_state = causal_conv(xs, self.conv_weight[:, 0], self.conv_bias, conv_state, valid)
        xs = self.act(xs)
        if mask is not None:
            xs = xs * mask
        dt, b, c = torch.split(
            self.x_proj(xs), [self.dt_rank, self.state_size, self.state_size], dim=-1
        )
        if self.dt_norm is not None:
            dt, b, c = self.dt_norm(dt), self.b_norm(b), self.c_norm(c)
        # [n, t, channels]
        dt = F.softplus(F.linear(dt, self.dt_proj.plain()) + self.dt_proj.bias.float())
        if mask is not None:
            # a padding step: decay exp(0) = 1 and no input, the state passes unchanged
            dt = dt * mask
        a = -torch.exp(self.A_log.float())  # [channels, state]
        h = ssm_state.float()
        u = xs.float()
        outs = []
        for i in range(x.shape[1]):
            step_dt = dt[:, i].unsqueeze(-1)  # [n, channels, 1]
            h = torch.exp(step_dt * a) * h + step_dt * b[:, i].float().unsqueeze(1) * u[
                :, i
            ].unsqueeze(-1)
            outs.append(torch.matmul(h.to(dtype), c[:, i].unsqueeze(-1)).squeeze(-1))
        y = torch.stack(outs, dim=1) + xs * self.D.float()
        y = y * F.silu(z)
        return self.out_proj(y.to(dtype)), (conv_state.to(ssm_state.dtype), h.to(ssm_state.dtype))
