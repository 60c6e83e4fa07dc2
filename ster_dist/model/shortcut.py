"""Shortcut-connected experts (LongCat-Flash): a mixture of experts that reads one layer's
feed-forward input and joins the residual at the end of the next layer, beside that layer's own
feed-forward.

The config's `shortcut_experts` (set by the family's normalisation) turns it on: each even layer 2k
holds the experts (`layers.{2k}.shortcut.*`, moe/layer.py's MoE under the model's MoEConfig) and
runs them on its normed feed-forward input; the step hands their output on, and layer 2k + 1 adds it
after its own feed-forward, as LongCat's stored layer k does with its two halves. The experts are
token-wise, so the static cache, the paged engine and expert parallelism see nothing new.
"""

from __future__ import annotations

from ster_dist.config import ModelConfig
from ster_dist.moe.layer import MoE
from ster_dist.parallel.ctx import ParallelCtx

HANDED_ON = "shortcut_experts"  # the step's key for the output on its way to the joining layer


def shortcut_experts(cfg: ModelConfig, layer: int, ctx: ParallelCtx) -> MoE | None:
    """The experts `layer` runs on its feed-forward input, or None where it runs none."""
    return MoE(cfg, ctx, layer) if cfg.raw.get("shortcut_experts") and layer % 2 == 0 else None


def joins_shortcut(cfg: ModelConfig, layer: int) -> bool:
    """Whether the experts of the layer before join the residual at the end of `layer`."""
    return bool(cfg.raw.get("shortcut_experts")) and layer % 2 == 1
