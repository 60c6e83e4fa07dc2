"""The short convolution (LFM2's token mixer): in_proj to three gates B, C and x, a depthwise causal
convolution over B * x, then C times its output through out_proj. Its state per sequence is the last
kernel - 1 inputs of the convolution.

Every channel is its own: tensor parallelism gives each rank a share of the channels, its rows of
each of B, C and x in in_proj (column-split), their kernels, and their columns of out_proj
(row-split, reduced). Settings come from the config itself: conv_L_cache (the kernel width) and
conv_bias.
"""

from __future__ import annotations

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.layers.causal_conv import causal_conv
from ster_dist.model.recurrent import RecurrentMixer
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ColumnLinear, RowLinear, ShardedModule


class _DepthwiseKernels(ShardedModule):
    """One kernel per channel, stored as Transformers' Conv1d keeps it ([channels, 1, kernel]); this
    rank's channels only."""

    def __init__(self, channels: int, kernel: int, rows: tuple[int, int], bias: bool):
        super().__init__()
        self._param("weight", Shard((channels, 1, kernel), 0, (rows,)))
        if bias:
            self._param("bias", Shard((channels,), 0, (rows,)))
        else:
            self.bias = None


class ShortConv(RecurrentMixer, nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        # unstated (missing or null) keys take Transformers' defaults
        kernel, bias = cfg.raw.get("conv_L_cache"), cfg.raw.get("conv_bias")
        kernel, bias = 3 if kernel is None else kernel, False if bias is None else bias
        if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1:
            raise Refusal(
                f"invalid model config: conv_L_cache is {kernel!r}; state the short convolution's "
                "kernel width as a positive integer"
            )
        if not isinstance(bias, bool):
            raise Refusal(f"invalid model config: conv_bias is {bias!r}; state it as true or false")
        hidden = cfg.hidden_size
        c0, c1 = ctx.split(hidden)
        self.layer, self.kernel, self.channels = layer, kernel, c1 - c0
        # in_proj's rows are B, then C, then x, each `hidden` wide: this rank takes its channels of
        # each
        self.in_proj = ColumnLinear(
            hidden, 3 * hidden, tuple((p * hidden + c0, p * hidden + c1) for p in range(3)), bias
        )
        self.conv = _DepthwiseKernels(hidden, kernel, (c0, c1), bias)
        self.out_proj = RowLinear(hidden, hidden, ctx, bias, cols=(c0, c1))

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.channels, self.kernel - 1),)

    def _scan(
        self, x: torch.Tensor, valid: torch.Tensor | None, state: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        # a padding token's input counts as zero, as a fresh sequence's past does (causal_conv masks
        # it)
        y, conv_state = causal_conv(b * h, self.conv.weight[:, 0], self.conv.bias, state[0], valid)
        return self.out_proj(c * y), (conv_state,)
