"""Layer kinds: the token mixers and feed-forwards a block can hold, picked per layer from the
config.

A family states which kind each layer is (ModelConfig.mixers / feed_forwards, filled by the family's
config normalisation from `layer_types`, `hybrid_override_pattern`, `layers_block_type`, ...); the
block looks the kind up here and builds it. A mixer is one of two sorts:

- attention (keeps keys and values per position): has `kv_shape`, ((heads, width), (heads, width))
  of one position on this rank, and reaches its keys through `step.attend`;
- recurrent (keeps one state per sequence: Mamba, gated delta, Kimi delta, lightning, short
  convolution): has
  `state_shapes()`, the shapes of one sequence's state on this rank, and runs its scan through
  `step.recur(layer, x, scan, fresh)` (model/step.py), which hands it each sequence's state;
- none: no token mixer, the block is its feed-forward alone behind its first norm (Nemotron-H's "-"
  layers);
- both (Zamba2's hybrid layers, model/shared_block.py): keys and values of a shared attention block,
  and a Mamba-2 state, under the same layer index.
- Inkling's attention (model/inkling.py): keys and values like attention, and the windows of its
  short convolutions, each a state of its own under a (layer, name) key (model/residual_conv.py).
- side by side (`parts`): several of the kinds above on the same input, summed, each times the
  multipliers the config states under the part's keys (Falcon-H1's attention beside Mamba-2;
  model/side_by_side.py). Each part lives at its own site, so the layer keeps the keys of its
  attention and the state of its scan.

Every mixer takes global sizes and the ParallelCtx, and returns the full hidden width (its output
projection reduces across tensor-parallel ranks). Its parameters live at the block's site for its
sort: `layers.{i}.attn.*` for attention, `layers.{i}.mixer.*` for recurrent kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from ster_dist.config import ATTENTION_MIXERS, FEED_FORWARD_KINDS, MIXER_KINDS, ModelConfig
from ster_dist.layers.mlp import MLP
from ster_dist.model.attention import Attention
from ster_dist.model.block_sparse import BlockSparseAttention
from ster_dist.model.compressed_attention import CompressedAttention, v4_layer
from ster_dist.model.gated_delta import GatedDeltaNet
from ster_dist.model.inkling import InklingAttention
from ster_dist.model.kimi_delta import KimiDeltaAttention
from ster_dist.model.lightning import LightningAttention
from ster_dist.model.loop_attention import LoopAttention
from ster_dist.model.mamba import MambaMixer
from ster_dist.model.mamba2 import Mamba2Mixer
from ster_dist.model.mla import LatentAttention
from ster_dist.model.query_bottleneck import BottleneckAttention
from ster_dist.model.shared_block import Mamba2SharedBlock
from ster_dist.model.short_conv import ShortConv
from ster_dist.model.side_by_side import SideBySide
from ster_dist.model.experts_beside_dense import ExpertsBesideDense
from ster_dist.moe.layer import MoE
from ster_dist.parallel.ctx import ParallelCtx

Build = Callable[[ModelConfig, int, ParallelCtx], nn.Module]


@dataclass(frozen=True)
class MixerKind:
    build: Build
    # the block attribute (and parameter-name segment) the mixer lives at: "attn" | "mixer"
    site: str
    # False: the block has no norm before the mixer, which reads its input as is
    normed: bool = True
    # side by side: (kind, its input multiplier's config key, its output multiplier's) per part;
    # `site` is then
    # the attention part's, and the block places every part at its own kind's site
    parts: tuple[tuple[str, str, str], ...] = ()

    @property
    def attention(self) -> bool:
        return self.site == "attn"


def side_by_side(*parts: tuple[str, str, str]) -> MixerKind:
    """A kind running `parts` (kind, input multiplier key, output multiplier key) on one input,
    summed."""

    def build(cfg: ModelConfig, layer: int, ctx: ParallelCtx) -> SideBySide:
        return SideBySide(
            cfg,
            tuple(
                (kind, MIXERS[kind].build(cfg, layer, ctx), into, out) for kind, into, out in parts
            ),
        )

    sites = [MIXERS[kind].site for kind, _, _ in parts]
    assert len(set(sites)) == len(sites), "two parts of a side-by-side kind at one site"
    return MixerKind(build, "attn" if "attn" in sites else sites[0], parts=parts)


MIXERS: dict[str, MixerKind] = {
    "attention": MixerKind(Attention, "attn"),
    "latent_attention": MixerKind(LatentAttention, "attn"),
    "short_conv": MixerKind(ShortConv, "mixer"),
    "mamba2": MixerKind(Mamba2Mixer, "mixer"),
    # the feed-forward alone (Nemotron-H's "-" layers)
    "none": MixerKind(lambda cfg, layer, ctx: None, "mixer"),
    "gated_delta": MixerKind(GatedDeltaNet, "mixer"),
    "mamba": MixerKind(MambaMixer, "mixer"),
    "kimi_delta": MixerKind(KimiDeltaAttention, "mixer"),
    # Zamba2's hybrid layers: the shared block reads the un-normed input; the Mamba-2 layer's norm
    # is the mixer's
    "mamba2_shared_block": MixerKind(Mamba2SharedBlock, "mixer", normed=False),
    "lightning": MixerKind(LightningAttention, "mixer"),
    "inkling_attention": MixerKind(InklingAttention, "attn"),
    "loop_attention": MixerKind(LoopAttention, "attn"),
    "bottleneck_attention": MixerKind(BottleneckAttention, "attn"),  # Step3's query bottleneck
    "block_sparse_attention": MixerKind(BlockSparseAttention, "attn"),  # MiniMax Sparse Attention
    # DeepSeek-V4's sliding, compressed sparse and heavily compressed layers
    "compressed_attention": MixerKind(
        lambda cfg, layer, ctx: CompressedAttention(v4_layer(cfg, layer), layer, ctx), "attn"
    ),
}
# Falcon-H1's layers, under its config's names for the multipliers
MIXERS["attention_mamba2"] = side_by_side(
    ("attention", "attention_in_multiplier", "attention_out_multiplier"),
    ("mamba2", "ssm_in_multiplier", "ssm_out_multiplier"),
)

FEED_FORWARDS: dict[str, Callable[[ModelConfig, int, ParallelCtx], nn.Module | None]] = {
    "dense": lambda cfg, layer, ctx: MLP(
        cfg,
        ctx,
        cfg.layer_intermediate[layer] if cfg.layer_intermediate else None,
        sparsity=cfg.gate_sparsity(layer),
    ),
    "moe": lambda cfg, layer, ctx: MoE(cfg, ctx, layer),
    "none": lambda cfg, layer, ctx: None,  # a block of the mixer alone (Mamba)
    # Gemma 4's enable_moe_block
    "dense_and_moe": lambda cfg, layer, ctx: ExpertsBesideDense(cfg, ctx, layer),
}

assert set(MIXERS) <= set(MIXER_KINDS) and set(FEED_FORWARDS) == set(FEED_FORWARD_KINDS)
assert {name for name, kind in MIXERS.items() if kind.attention} == set(ATTENTION_MIXERS)
