"""The residual short convolution (Inkling's k_sconv, v_sconv, attn_sconv, mlp_sconv): its input
plus a depthwise causal convolution of it, computed in f32, continued across steps by each
sequence's window of its last kernel - 1 inputs.

Each one keeps its window as a recurrent state of its own under `state_key` ((layer, name)), which
the static cache and the paged cache's state slots hold beside the layer's keys (model/paged.py
gathers every module that has one), so one layer may convolve at several points of its block.
Channels are split with the projection they convolve (`rows`), or held whole where the input is the
full hidden state.
"""

from __future__ import annotations

import torch

from ster_dist.layers.causal_conv import causal_conv
from ster_dist.parallel.ctx import Shard
from ster_dist.parallel.linear import ShardedModule


class ResidualConv(ShardedModule):
    """weight [channels, 1, kernel] as the checkpoint stores it; this rank's channels `rows` (None:
    all)."""

    def __init__(
        self,
        channels: int,
        kernel: int,
        state_key: tuple[int, str],
        rows: tuple[int, int] | None = None,
    ):
        super().__init__()
        self._param(
            "weight",
            Shard((channels, 1, kernel), 0, (rows,)) if rows else Shard((channels, 1, kernel)),
        )
        self.state_key, self.kernel = state_key, kernel
        self.channels = rows[1] - rows[0] if rows else channels

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.channels, self.kernel - 1),)

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        return step.recur(self.state_key, x, self._scan, self._fresh)

    def _fresh(self, n: int) -> tuple[torch.Tensor, ...]:
        return (self.weight.new_zeros((n, self.channels, self.kernel - 1)),)

    def _scan(
        self, x: torch.Tensor, valid: torch.Tensor | None, state: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        # f32 as Inkling keeps these modules; a padding token's input counts as zero (causal_conv
        # masks it)
        wide = x.float()
        y, window = causal_conv(wide, self.weight[:, 0].float(), None, state[0], valid)
        return (wide + y).to(x.dtype), (window,)
