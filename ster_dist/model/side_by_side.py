"""Token mixers side by side (Falcon-H1's layers): several kinds read the same normed input, each
scaled by its own input multiplier, and their outputs, each scaled by its own output multiplier, are
summed.

The parts are the existing kinds, built by their own builders and placed by the block at their own
sites (`layers.{i}.attn.*` for attention, `layers.{i}.mixer.*` for a recurrent kind), so their
parameters, shards, name maps, keys and states are exactly theirs. This object is not a module: it
holds the built parts and the multipliers, and shows the cache what the parts keep (attention's
`kv_shape`, a recurrent kind's
`state_shapes()`), so a layer keeps its keys and its scan state side by side. The multipliers (muP)
are applied in forward; the checkpoint's tensors stay as stored.
"""

from __future__ import annotations

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal


def _multiplier(raw: dict, key: str) -> float:
    value = raw.get(key)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refusal(
            f"invalid model config: {key} is {value!r}; it must be a number (or left out for one)"
        )
    return float(value)


class SideBySide:
    """parts: (kind name, built module, input multiplier key, output multiplier key) per kind."""

    def __init__(self, cfg: ModelConfig, parts: tuple[tuple[str, nn.Module, str, str], ...]):
        self.parts = {name: module for name, module, _, _ in parts}
        self.scales = [
            (module, _multiplier(cfg.raw, into), _multiplier(cfg.raw, out))
            for _, module, into, out in parts
        ]
        for module in self.parts.values():
            if hasattr(module, "kv_shape"):
                self.kv_shape = module.kv_shape
            if hasattr(module, "state_shapes"):
                self.state_shapes = module.state_shapes

    def __call__(self, x: torch.Tensor, step) -> torch.Tensor:
        total = None
        for module, into, out in self.scales:
            y = module(x if into == 1.0 else x * into, step)
            y = y if out == 1.0 else y * out
            total = y if total is None else total + y
        return total
