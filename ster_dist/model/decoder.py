"""The decoder: one stack of blocks, each of the layer kinds the config picks, with switches from
ModelConfig, for every family.

Named hook sites sit on the residual stream after every layer ("layers.{i}"):
capture and steering attach there through add_hook, and nowhere else.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.model.cache import KVCache
from ster_dist.model.kinds import FEED_FORWARDS, MIXERS
from ster_dist.model.norm import Norm
from ster_dist.model.paged import Chunk, PagedCache
from ster_dist.model.paged_step import PagedStep
from ster_dist.model.per_layer_input import PerLayerGate, PerLayerInputs
from ster_dist.model.residual_conv import ResidualConv
from ster_dist.model.rope import RotaryTables
from ster_dist.model.step import StepState
from ster_dist.parallel.ctx import SINGLE, ParallelCtx, Shard
from ster_dist.parallel.linear import (FusedColumns, Replicated, VocabEmbedding, VocabHead, module_shards,
                                       tie_parameters)

Hook = Callable[[torch.Tensor], torch.Tensor | None]


class Block(nn.Module):
    """One layer: a token mixer (attention, or a recurrent kind) and a feed-forward (dense, experts or
    none), each behind its norms, of the kinds the config picks for this layer (model/kinds.py)."""

    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()

        def norm(offset: float = cfg.norm_offset, eps: float = cfg.norm_eps):
            return Norm(cfg.hidden_size, eps, cfg.norm_kind, cfg.norm_bias, offset, affine=cfg.norm_affine)

        post_offsets = cfg.post_norm_offsets or (cfg.norm_offset, cfg.norm_offset)
        post_eps = cfg.norm_eps if cfg.post_norm_eps is None else cfg.post_norm_eps

        kind = MIXERS[cfg.mixer(layer)]
        self.site = kind.site
        mixer = kind.build(cfg, layer, ctx)
        # side by side (model/side_by_side.py): each part at its own site; the sum of them is no module
        self.side_by_side = mixer if kind.parts else None
        pre_attn, post_attn, pre_mlp, post_mlp = (cfg.pre_attn_norm, cfg.post_attn_norm, cfg.pre_mlp_norm,
                                                  cfg.post_mlp_norm_at(layer))
        if cfg.recurrent_pre_norm and not kind.attention and mixer is not None:
            pre_attn, post_attn, pre_mlp, post_mlp = True, False, True, False
        if not kind.normed:  # the mixer norms its own input (Zamba2's hybrid layers)
            pre_attn = False
        self.attn_norm = norm() if pre_attn else None
        sites = ({MIXERS[name].site: part for name, part in mixer.parts.items()} if kind.parts
                 else {kind.site: mixer})
        for site, part in sites.items():
            setattr(self, site, part)
        self.post_attn_norm = norm(post_offsets[0], post_eps) if post_attn and mixer is not None else None
        self.mlp = FEED_FORWARDS[cfg.feed_forward(layer)](cfg, layer, ctx)
        # a block without a token mixer has one norm, its first (attn_norm), before the feed-forward
        self.mlp_norm = norm() if pre_mlp and self.mlp is not None and mixer is not None else None
        self.post_mlp_norm = norm(post_offsets[1], post_eps) if post_mlp and self.mlp is not None else None
        self.mlp_reads_residual = getattr(self.mlp, "reads_residual", False)
        # Inkling: each sublayer's output passes a residual short convolution before joining the residual
        self.attn_sconv = self.mlp_sconv = None
        if cfg.sublayer_conv:
            self.attn_sconv = ResidualConv(cfg.hidden_size, cfg.sublayer_conv, (layer, "attn_sconv"))
            self.mlp_sconv = ResidualConv(cfg.hidden_size, cfg.sublayer_conv, (layer, "mlp_sconv"))
        self.parallel = cfg.parallel_block
        self.residual_multiplier = cfg.residual_multiplier
        self.residual_fp32 = cfg.residual_fp32
        # MiniMax: residual * alpha + output * beta per sublayer, the residual its normed input under postnorm
        self.factors = cfg.residual_factors[layer] if cfg.residual_factors else None
        self.residual_from_norm = cfg.residual_from_norm
        # Gemma 4: the layer's own input added to its output through a gate, and the output times a stored scalar
        self.per_layer_gate = PerLayerGate(cfg, layer, ctx) if cfg.per_layer_input else None
        self.layer_scalar = Replicated((1,)) if cfg.layer_scalar else None

    @property
    def token_mixer(self) -> nn.Module | None:
        """The layer's attention or recurrent mixer, whichever site it sits at, or its side-by-side parts
        (None: the feed-forward alone)."""
        return self.side_by_side if self.side_by_side is not None else getattr(self, self.site)

    def forward(self, x: torch.Tensor, step: StepState | PagedStep) -> torch.Tensor:
        h = self._sublayers(x, step)
        if self.per_layer_gate is not None:
            h = h + self.per_layer_gate(h, step.handed_on["per_layer_inputs"])
        return h * self.layer_scalar.weight if self.layer_scalar is not None else h

    def _sublayers(self, x: torch.Tensor, step: StepState | PagedStep) -> torch.Tensor:
        residual = x
        if self.residual_fp32:  # Mamba: the sum kept in f32, each layer reading it in the model's dtype
            residual, x = x.float(), x.to(self.attn_norm.weight.dtype)
        a_in = self.attn_norm(x) if self.attn_norm is not None else x
        if self.token_mixer is None:  # the feed-forward alone, behind the block's first norm
            m = self.mlp(a_in)
            return residual + self._scaled(self.post_mlp_norm(m) if self.post_mlp_norm is not None else m)
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
        m_in = self.mlp_norm(h) if self.mlp_norm is not None else h
        # Gemma 4's experts beside the dense feed-forward read the residual too
        m = self.mlp(m_in, h) if self.mlp_reads_residual else self.mlp(m_in)
        if self.mlp_sconv is not None:
            m = self.mlp_sconv(m, step)
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return h + self._scaled(m)

    def _weighted(self, x: torch.Tensor, a_in: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """MiniMax's block: each sublayer's output weighed against its residual (model/kinds.py's mixer, then
        the feed-forward behind mlp_norm)."""
        mixer_alpha, mixer_beta, mlp_alpha, mlp_beta = self.factors
        h = (a_in if self.residual_from_norm else x) * mixer_alpha + a * mixer_beta
        m_in = self.mlp_norm(h)
        return (m_in if self.residual_from_norm else h) * mlp_alpha + self.mlp(m_in) * mlp_beta

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        # Granite's residual multiplier; one is the common case and costs nothing
        return y if self.residual_multiplier == 1.0 else y * self.residual_multiplier


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx = SINGLE):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        # OPT's table holds position_offset rows before position zero
        self.pos_embed = (Replicated((cfg.max_position + cfg.position_offset, cfg.hidden_size))
                          if cfg.learned_positions else None)
        self.embed_norm = Norm(cfg.hidden_size, cfg.norm_eps, cfg.norm_kind, cfg.norm_bias, cfg.norm_offset,
                               affine=cfg.norm_affine and cfg.embed_norm_affine) if cfg.embed_norm else None
        self.per_layer_inputs = PerLayerInputs(cfg, ctx) if cfg.per_layer_input else None
        self.layers = nn.ModuleList(Block(cfg, i, ctx) for i in range(cfg.num_layers))
        for block in self.layers:  # a layer whose shared block another layer holds uses that layer's weights
            owner = getattr(block.token_mixer, "shares_with", None)
            if owner is not None:
                tie_parameters(block.token_mixer.shared, self.layers[owner].token_mixer.shared)
        for i in range(cfg.loop_layers, cfg.num_layers if cfg.loop_layers else 0):
            # a looped model's later passes run the stored layers again: their weights, each layer its own cache
            tie_parameters(self.layers[i], self.layers[i % cfg.loop_layers])
        # the layers after which the final norm closes a pass that is not the last (Nanbeige)
        self.pass_ends = (frozenset(range(cfg.loop_layers - 1, cfg.num_layers - 1, cfg.loop_layers))
                          if cfg.loop_layers and cfg.loop_pass_norm else frozenset())
        final_offset = cfg.norm_offset if cfg.final_norm_offset is None else cfg.final_norm_offset
        self.final_norm = Norm(cfg.hidden_size, cfg.norm_eps, cfg.norm_kind, cfg.norm_bias, final_offset,
                               affine=cfg.norm_affine)
        self.lm_head = VocabHead(cfg.vocab_size, cfg.hidden_size, ctx, cfg.lm_head_bias,
                                 self.embed if cfg.tie_word_embeddings else None)
        self.tables = RotaryTables(cfg.max_position)
        self.hooks: dict[int, list[Hook]] = {}

    # -- parameters as the loader sees them -----------------------------------
    def shards(self) -> dict[str, Shard]:
        """Every parameter's name and Shard, in the decoder's own names."""
        return module_shards(self)

    def fuse_projections(self) -> None:
        """Once filled: q/k/v and gate/up each become one product (their parameters views of it)."""
        done: dict = {}  # a block several layers share is fused once
        for module in self.modules():
            if isinstance(module, FusedColumns):
                module.fuse(done)

    # -- hook sites -----------------------------------------------------------
    def add_hook(self, layer: int, hook: Hook) -> Callable[[], None]:
        """Call hook(residual) after `layer`; a returned tensor replaces the residual. Returns a remover."""
        if not 0 <= layer < self.cfg.num_layers:
            raise IndexError(f"layer {layer} is outside the model's {self.cfg.num_layers} layers")
        self.hooks.setdefault(layer, []).append(hook)
        return lambda: self.hooks[layer].remove(hook)

    # -- forward --------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None) -> KVCache:
        shapes = [getattr(block.token_mixer, "kv_shape", None) for block in self.layers]
        return KVCache(shapes, batch, capacity, dtype or self.embed.weight.dtype, self.embed.weight.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits [batch, seq (or 1), vocab] for token ids [batch, seq]."""
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
        if valid is None:
            valid = torch.ones_like(ids, dtype=torch.bool)
        step = StepState(positions, valid, self.tables, cache)
        h = self._layers(self._embed(ids, positions), step, ids)
        if last_only:
            h = h[:, -1:]
        return self._logits(h)

    def final_hidden(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The final norm's output [batch, seq, hidden] for right-padded ids: what the head reads, and what a
        reward head (tune/preference.py) reads instead of it."""
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        h = self._layers(self._embed(ids, positions), StepState(positions, valid, self.tables, None), ids)
        return self.final_norm(h).to(self.embed.weight.dtype)

    def forward_paged(self, ids: torch.Tensor, chunks: list[Chunk], cache: PagedCache) -> torch.Tensor:
        """Logits [len(chunks), vocab] of each chunk's last token, for ids [tokens]: every chunk's new tokens,
        concatenated in chunk order. Token-wise layers run on the packed tokens; only attention splits them
        by sequence (PagedStep)."""
        step = PagedStep(chunks, cache, self.tables, ids)
        h = self._layers(self._embed(ids.unsqueeze(0), step.positions), step, ids.unsqueeze(0))
        return self._logits(h[:, step.last_tokens])[0]

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.cfg.embed_scale != 1.0:
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        if self.pos_embed is not None:
            h = h + self.pos_embed.weight[positions + self.cfg.position_offset]
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        return h

    def _layers(self, h: torch.Tensor, step: StepState | PagedStep, ids: torch.Tensor) -> torch.Tensor:
        step.embeddings = h  # the embedding output, which Zamba2's shared blocks read beside the hidden state
        if self.per_layer_inputs is not None:  # Gemma 4's E models: every layer's own input, made once
            step.handed_on["per_layer_inputs"] = self.per_layer_inputs(ids, h)
        kept: dict[int, torch.Tensor] = {}  # block skip connections (Solar Pro): each slot's last kept state
        for i, block in enumerate(self.layers):
            if self.cfg.block_skips:
                h = self._skip(i, h, kept)
            h = block(h, step)
            if i in self.pass_ends:
                h = self.final_norm(h)
            for hook in self.hooks.get(i, ()):
                replaced = hook(h)
                if replaced is not None:
                    h = replaced
        return h

    def _skip(self, layer: int, h: torch.Tensor, kept: dict[int, torch.Tensor]) -> torch.Tensor:
        """Before `layer`: every skip keeping here keeps h, then every skip mixing here mixes its kept state in.
        Token-wise, so the cached and paged reads match the whole one."""
        for slot, (keep, _, _) in enumerate(self.cfg.block_skips):
            if layer in keep:
                kept[slot] = h
        for slot, (_, mix, weight) in enumerate(self.cfg.block_skips):
            if layer in mix:
                h = kept[slot] * weight + h * (1 - weight)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        # an f32 residual stream (residual_fp32) meets the head in the model's dtype, as Transformers casts it
        logits = self.lm_head(self.final_norm(h).to(self.embed.weight.dtype))
        if self.cfg.logit_multiplier != 1.0:
            logits = logits * self.cfg.logit_multiplier
        if self.cfg.logit_softcap is not None:
            logits = torch.tanh(logits / self.cfg.logit_softcap) * self.cfg.logit_softcap
        if self.cfg.scored_vocab is not None:  # the head's rows past it are padding (Inkling)
            logits = logits[..., : self.cfg.scored_vocab]
        return logits


def meta_decoder(cfg: ModelConfig, ctx: ParallelCtx = SINGLE, dtype: torch.dtype = torch.float32) -> Decoder:
    """The decoder's shapes only, on the meta device: what the loader allocates and fills, and what
    a writer walks for parameter names. Cast while shapes only, so nothing is allocated twice."""
    with torch.device("meta"):
        return Decoder(cfg, ctx).to(dtype)
