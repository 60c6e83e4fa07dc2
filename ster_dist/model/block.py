"""One decoder layer: a token mixer and a feed-forward of the kinds the config picks for the layer
(model/kinds.py), each behind its norms, joined to the residual stream as the family's block joins
them (pre- or post-norm, parallel, weighted, hyper-connected, inside AltUp's predict and correct).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.model.altup import AltUpLayer
from ster_dist.model.hyper_connection import HyperConnection
from ster_dist.model.kinds import FEED_FORWARDS, MIXERS
from ster_dist.model.laurel import Laurel
from ster_dist.model.norm import Norm
from ster_dist.model.paged_step import PagedStep
from ster_dist.model.per_layer_input import PerLayerGate
from ster_dist.model.residual_conv import ResidualConv
from ster_dist.model.shortcut import HANDED_ON, joins_shortcut, shortcut_experts
from ster_dist.model.step import StepState
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import Replicated


class Block(nn.Module):
    """One layer: a token mixer (attention, or a recurrent kind) and a feed-forward (dense, experts
    or none), each behind its norms, of the kinds the config picks for this layer
    (model/kinds.py)."""

    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()

        def norm(offset: float = cfg.norm_offset, eps: float = cfg.norm_eps):
            return Norm(
                cfg.hidden_size,
                eps,
                cfg.norm_kind,
                cfg.norm_bias,
                offset,
                affine=cfg.norm_affine,
                scale_f32=cfg.norm_scale_f32,
                groups=cfg.norm_groups,
            )

        post_offsets = cfg.post_norm_offsets or (cfg.norm_offset, cfg.norm_offset)
        post_eps = cfg.norm_eps if cfg.post_norm_eps is None else cfg.post_norm_eps

        kind = MIXERS[cfg.mixer(layer)]
        self.site = kind.site
        mixer = kind.build(cfg, layer, ctx)
        # side by side (model/side_by_side.py): each part at its own site; the sum of them is no
        # module
        self.side_by_side = mixer if kind.parts else None
        pre_attn, post_attn, pre_mlp, post_mlp = (
            cfg.pre_attn_norm,
            cfg.post_attn_norm,
            cfg.pre_mlp_norm,
            cfg.post_mlp_norm_at(layer),
        )
        if cfg.recurrent_pre_norm and not kind.attention and mixer is not None:
            pre_attn, post_attn, pre_mlp, post_mlp = True, False, True, False
        if not kind.normed:  # the mixer norms its own input (Zamba2's hybrid layers)
            pre_attn = False
        self.attn_norm = norm() if pre_attn else None
        sites = (
            {MIXERS[name].site: part for name, part in mixer.parts.items()}
            if kind.parts
            else {kind.site: mixer}
        )
        for site, part in sites.items():
            setattr(self, site, part)
        self.post_attn_norm = (
            norm(post_offsets[0], post_eps) if post_attn and mixer is not None else None
        )
        self.mlp = FEED_FORWARDS[cfg.feed_forward(layer)](cfg, layer, ctx)
        # LongCat-Flash: experts over this feed-forward's input, joining the residual a layer later
        self.shortcut = shortcut_experts(cfg, layer, ctx)
        self.joins_shortcut = joins_shortcut(cfg, layer)
        # neither half (DeciLM's no_op layers): the residual passes as is
        if mixer is None and self.mlp is None:
            self.attn_norm = None
        # a block without a token mixer has one norm, its first (attn_norm), before the feed-forward
        self.mlp_norm = norm() if pre_mlp and self.mlp is not None and mixer is not None else None
        self.post_mlp_norm = (
            norm(post_offsets[1], post_eps) if post_mlp and self.mlp is not None else None
        )
        # Inkling: each sublayer's output passes a residual short convolution before joining the
        # residual
        self.attn_sconv = self.mlp_sconv = None
        if cfg.sublayer_conv:
            self.attn_sconv = ResidualConv(
                cfg.hidden_size, cfg.sublayer_conv, (layer, "attn_sconv")
            )
            self.mlp_sconv = ResidualConv(cfg.hidden_size, cfg.sublayer_conv, (layer, "mlp_sconv"))
        self.parallel = cfg.parallel_block
        self.residual_multiplier = cfg.residual_multiplier
        self.residual_fp32 = cfg.residual_fp32
        # MiniMax: residual * alpha + output * beta per sublayer, the residual its normed input
        # under postnorm
        self.factors = cfg.residual_factors[layer] if cfg.residual_factors else None
        self.residual_from_norm = cfg.residual_from_norm
        # Gemma 3n: Laurel beside attention, and the block inside AltUp's predict and correct
        self.laurel = Laurel(cfg) if cfg.laurel_rank else None
        self.altup = AltUpLayer(cfg, layer) if cfg.altup is not None else None
        # hyper-connections (model/hyper_connection.py): the residual is several streams, each
        # sublayer's own
        self.attn_hc = HyperConnection(cfg) if cfg.hyper_streams else None
        self.mlp_hc = HyperConnection(cfg) if cfg.hyper_streams else None
        # Gemma 4: the layer's own input added to its output through a gate, and the output times a
        # stored scalar
        self.per_layer_gate = (
            PerLayerGate(cfg, layer, ctx) if cfg.per_layer_input and cfg.altup is None else None
        )
        self.layer_scalar = Replicated((1,)) if cfg.layer_scalar else None
        # Gemma 4's experts beside the dense feed-forward read the residual too
        self.mlp_reads_residual = getattr(self.mlp, "reads_residual", False)

    @property
    def token_mixer(self) -> nn.Module | None:
        """The layer's attention or recurrent mixer, whichever site it sits at, or its side-by-side
        parts (None: the feed-forward alone)."""
        return self.side_by_side if self.side_by_side is not None else getattr(self, self.site)

    def forward(self, x: torch.Tensor, step: StepState | PagedStep) -> torch.Tensor:
        """x: the residual stream [batch, seq, hidden], AltUp's copies of it [copies, batch, seq,
        hidden], or hyper-connected streams [..., streams, hidden]."""
        if self.altup is not None:
            return self.altup(x, step, self._block)
        if self.attn_hc is not None:
            return self._hyper(x, step)
        h = self._block(x, step)
        if self.per_layer_gate is not None:
            h = h + self.per_layer_gate(h, step.layer_input(self.per_layer_gate.layer))
        return h * self.layer_scalar.weight if self.layer_scalar is not None else h

    def _block(self, x: torch.Tensor, step: StepState | PagedStep) -> torch.Tensor:
        residual = x
        # Mamba: the sum kept in f32, each layer reading it in the model's dtype
        if self.residual_fp32:
            residual, x = x.float(), x.to(self.attn_norm.weight.dtype)
        a_in = self.attn_norm(x) if self.attn_norm is not None else x
        if self.token_mixer is None and self.mlp is None:
            return x
        if self.token_mixer is None:  # the feed-forward alone, behind the block's first norm
            m = self.mlp(a_in)
            return residual + self._scaled(
                self.post_mlp_norm(m) if self.post_mlp_norm is not None else m
            )
        a = self.token_mixer(a_in, step)
        if self.attn_sconv is not None:
            a = self.attn_sconv(a, step)
        if self.factors is not None:
            return self._weighted(x, a_in, a)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        if self.mlp is None:
            return residual + self._scaled(a)
        if self.parallel:
            m = self.mlp(self.mlp_norm(x) if self.mlp_norm is not None else a_in)
            return residual + self._scaled(a + m)
        h = residual + self._scaled(a)
        if self.laurel is not None:  # Gemma 3n: attention's residual sum averaged with Laurel's
            h = (h + self.laurel(a_in)) / math.sqrt(2)
        m_in = self.mlp_norm(h) if self.mlp_norm is not None else h
        m = self.mlp(m_in, h) if self.mlp_reads_residual else self.mlp(m_in)
        if self.shortcut is not None:
            step.handed_on[HANDED_ON] = self.shortcut(m_in)
        if self.mlp_sconv is not None:
            m = self.mlp_sconv(m, step)
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        out = h + self._scaled(m)
        return out + step.handed_on.pop(HANDED_ON) if self.joins_shortcut else out

    def _hyper(self, streams: torch.Tensor, step: StepState | PagedStep) -> torch.Tensor:
        """A pre-norm block over hyper-connected streams [..., streams, hidden]: each sublayer reads
        their collapse and its output is spread back over them."""
        a_in, weights = self.attn_hc(streams)
        streams = self.attn_hc.join(streams, self.token_mixer(self.attn_norm(a_in), step), weights)
        m_in, weights = self.mlp_hc(streams)
        # every feed-forward a hyper-connected block holds (dense or experts) takes the step's token
        # ids: DeepSeek-V4's
        # hash layers route by them, the rest never read them
        return self.mlp_hc.join(
            streams, self.mlp(self.mlp_norm(m_in), token_ids=step.token_ids), weights
        )

    def _weighted(self, x: torch.Tensor, a_in: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """MiniMax's block: each sublayer's output weighed against its residual (model/kinds.py's
        mixer, then the feed-forward behind mlp_norm)."""
        mixer_alpha, mixer_beta, mlp_alpha, mlp_beta = self.factors
        h = (a_in if self.residual_from_norm else x) * mixer_alpha + a * mixer_beta
        m_in = self.mlp_norm(h)
        return (m_in if self.residual_from_norm else h) * mlp_alpha + self.mlp(m_in) * mlp_beta

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        # Granite's residual multiplier; one is the common case and costs nothing
        return y if self.residual_multiplier == 1.0 else y * self.residual_multiplier
