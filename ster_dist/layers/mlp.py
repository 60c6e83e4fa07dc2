"""The tensor-parallel feed-forward: gated (act(gate) * up, or MiniMax-M3's SwiGLU-OAI) or plain
(act(up)), column- then row-parallel. The decoder's dense layers and the experts' shared
feed-forward both build it.

Gemma 3n's activation sparsity keeps, of the gate's output, only what lies above its mean plus
Phi^-1(p) standard deviations (p the layer's sparsity), shifted down by that cutoff; mean and
deviation are over the whole intermediate width, so under tensor parallelism their sums are reduced
over the ranks."""

from __future__ import annotations

import math

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.layers.activation import XIELU, activation
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import ColumnLinear, FusedColumns, Replicated, RowLinear


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ParallelCtx,
        intermediate: int | None = None,
        sparsity: float = 0.0,
        limit: float = 0.0,
    ):
        """limit: min(act(gate), limit) * clamp(up, +-limit) when not 0 (Step 3.5's clamped
        layers)."""
        super().__init__()
        self.limit = limit
        self.oai = cfg.swiglu_oai  # (limit, alpha) of SwiGLU-OAI, or empty
        # GLM-5-Next clamps every SwiGLU's gate before the activation: act(min(gate, L)) * clamp(up,
        # +-L)
        self.limit_inside = float(cfg.raw.get("glu_limit_inside") or 0.0)
        inner = intermediate or cfg.intermediate_size
        rows = (ctx.split(inner),)
        self.gate = (
            ColumnLinear(cfg.hidden_size, inner, rows, cfg.mlp_up_bias) if cfg.mlp_gated else None
        )
        self.up = ColumnLinear(cfg.hidden_size, inner, rows, cfg.mlp_up_bias)
        self.down = RowLinear(inner, cfg.hidden_size, ctx, cfg.mlp_down_bias, cols=rows[0])
        self.act = XIELU() if cfg.hidden_act == "xielu" else activation(cfg.hidden_act)
        # one product once loaded (Decoder.fuse_projections)
        self.gate_up = FusedColumns(self.gate, self.up)
        # Falcon-H1's muP: the gate's output before the activation and the output, scaled (one
        # elsewhere)
        self.gate_multiplier, self.down_multiplier = cfg.mlp_multipliers
        # Inkling's global_scale: the output times a stored scale (a shared feed-forward never has
        # one)
        self.scale = Replicated((1,)) if cfg.mlp_output_scale and intermediate is None else None
        self.ctx, self.inner = ctx, inner
        # Phi^-1(p) in f32, as torch's standard normal icdf gives it to Transformers (on the CPU:
        # the decoder is
        # built on the meta device)
        p = torch.tensor(sparsity, dtype=torch.float32, device="cpu")
        self.cutoff_deviations = (
            float(torch.erfinv(2 * p - 1) * math.sqrt(2)) if sparsity > 0 else None
        )

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """What the down projection reads: act(gate) * up, or act(up)."""
        gate, up = self.gate_up(x)
        if gate is None:
            return self.act(up)
        if self.cutoff_deviations is not None:
            gate = self._sparse(gate)
        if self.oai:  # (clamp(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            limit, alpha = self.oai
            gate = gate.clamp(max=limit)
            return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
        if self.limit_inside:
            return self.act(gate.clamp(max=self.limit_inside)) * up.clamp(
                -self.limit_inside, self.limit_inside
            )
        if self.limit:
            return self.act(gate).clamp(max=self.limit) * up.clamp(-self.limit, self.limit)
        return self.act(self._scaled(gate, self.gate_multiplier)) * up

    def _sparse(self, gate: torch.Tensor) -> torch.Tensor:
        deviations = torch.tensor(self.cutoff_deviations, dtype=gate.dtype, device=gate.device)
        if self.ctx.tp_size == 1:
            mean, std = gate.mean(-1, keepdim=True), gate.std(-1, keepdim=True, unbiased=False)
        else:
            mean = self.ctx.all_reduce(gate.sum(-1, keepdim=True)) / self.inner
            std = (
                self.ctx.all_reduce((gate - mean).pow(2).sum(-1, keepdim=True)) / self.inner
            ).sqrt()
        return torch.relu(gate - (mean + std * deviations))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids: never read; taken so that a block hands a dense layer what it hands experts,
        which may route by them (moe/layer.py)."""
        y = self._scaled(self.down(self.hidden(x)), self.down_multiplier)
        return y * self.scale.weight if self.scale is not None else y

    @staticmethod
    def _scaled(y: torch.Tensor, multiplier: float) -> torch.Tensor:
        return y if multiplier == 1.0 else y * multiplier
