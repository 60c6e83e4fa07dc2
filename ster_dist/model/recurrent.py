"""What every recurrent layer kind (Mamba, Mamba-2, gated delta, Kimi delta, short convolution)
shares:
its forward hands the step its scan, and a fresh sequence's state is zeros of its state shapes.

A kind mixes this in before its module class and defines `layer`, `state_shapes()` and
`_scan(x, valid, state) -> (y, state)` (model/kinds.py states the contract)."""

from __future__ import annotations

import torch


class RecurrentMixer:
    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        return step.recur(self.layer, x, self._scan, self._fresh)

    def _fresh(self, n: int) -> tuple[torch.Tensor, ...]:
        like = next(self.parameters())  # the layer's dtype and device
        return tuple(like.new_zeros((n, *shape)) for shape in self.state_shapes())
