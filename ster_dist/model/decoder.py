"""The decoder: one stack of blocks, each of the layer kinds the config picks, with switches from
ModelConfig, for every family.

Named hook sites sit on the residual stream after every layer ("layers.{i}"): capture and steering
attach there through add_hook, and nowhere else. Where the stream is AltUp's copies (Gemma 3n,
model/altup.py), the site is the first copy, the one each block computes on.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.events import progress
from ster_dist.model.cache import KVCache
from ster_dist.model.altup import AltUpStream
from ster_dist.model.anchored import Anchored
from ster_dist.model.block import Block
from ster_dist.model.compiled import CompiledLayers, failures, why_eager
from ster_dist.model.host import upload
from ster_dist.model.hyper_connection import HyperHead, hooked, spread
from ster_dist.model.loop import loop_plan
from ster_dist.model.ngram_embedding import NgramEmbedding
from ster_dist.model.norm import Norm
from ster_dist.model.paged import Chunk, PagedCache
from ster_dist.model.paged_step import PagedStep
from ster_dist.model.per_layer_input import PerLayerInputs, per_layer_shape
from ster_dist.model.rope import RotaryTables
from ster_dist.model.step import StepState
from ster_dist.parallel.ctx import SINGLE, ParallelCtx, Shard
from ster_dist.parallel.linear import (
    FusedColumns,
    Replicated,
    VocabEmbedding,
    VocabHead,
    module_shards,
    tie_parameters,
)
from ster_dist.parallel.pipeline import stage_bounds

Hook = Callable[[torch.Tensor], torch.Tensor | None]


def stage_layers(cfg: ModelConfig, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers pipeline stage `pp_rank` of `pp_size` holds, balanced by parameter
    count (each layer built on the meta device: nothing allocated). The first stage counts the
    embedding, the last the norm and head (the embedding again when tied: the last stage holds it as
    its head)."""
    if pp_size == 1:
        return 0, cfg.num_layers
    held, sizes = _LAYER_SIZES
    if held is not cfg:  # every rank of a plan asks for the same config: measured once
        with torch.device("meta"):
            sizes = [
                sum(p.numel() for p in Block(cfg, i, SINGLE).parameters())
                for i in range(cfg.num_layers)
            ]
        _LAYER_SIZES[:] = [cfg, sizes]
    embed = cfg.vocab_size * cfg.hidden_size
    return stage_bounds(sizes, embed, embed + 2 * cfg.hidden_size, pp_size)[pp_rank]


_LAYER_SIZES: list = [None, []]  # (the config last measured, its layers' parameter counts)


class Elsewhere(nn.Module):
    """A layer another pipeline stage holds: no weights, no cache, never run here."""

    token_mixer = None


class Decoder(Anchored):
    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx = SINGLE):
        # the anchor: the dtype and device of this stage's weights, whichever modules it holds
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        # this pipeline stage's layers (all of them without --pp); the others are Elsewhere, keeping
        # indexes
        self.stage = stage_layers(cfg, ctx.pp_rank, ctx.pp_size)
        first, last = ctx.first_stage, ctx.last_stage
        # the last stage holds the embedding too when the head is tied to it
        self.embed = (
            VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
            if first or (last and cfg.tie_word_embeddings)
            else None
        )
        # LongCat-Flash-Lite: hashed n-gram embeddings averaged with the token's
        # (model/ngram_embedding.py)
        self.ngram = NgramEmbedding(cfg, ctx) if cfg.ngram is not None and first else None
        # OPT's table holds position_offset rows before position zero
        self.pos_embed = (
            Replicated((cfg.max_position + cfg.position_offset, cfg.hidden_size))
            if cfg.learned_positions and first
            else None
        )
        self.embed_norm = (
            Norm(
                cfg.hidden_size,
                cfg.norm_eps,
                cfg.norm_kind,
                cfg.norm_bias,
                cfg.norm_offset,
                affine=cfg.norm_affine and cfg.embed_norm_affine,
            )
            if cfg.embed_norm and first
            else None
        )
        # a looped model's passes (model/loop.py): the stacks they run, held before the layers so
        # that their
        # parameters are listed (and read) under the stacks' names, once (looped models run as one
        # stage)
        self.loop = loop_plan(cfg)
        if self.loop.stacks:
            n = cfg.loop_layers
            self.stacks = nn.ModuleList(
                nn.ModuleList(Block(cfg, self.loop.first_layer(s, j), ctx) for j in range(n))
                for s in range(self.loop.stacks)
            )
        self.loop_init = Replicated((cfg.hidden_size,)) if self.loop.init else None
        self.layers = nn.ModuleList(
            Block(cfg, i, ctx) if self.stage[0] <= i < self.stage[1] else Elsewhere()
            for i in range(cfg.num_layers)
        )
        self.altup = AltUpStream(cfg, ctx) if cfg.altup is not None else None
        # Gemma 3n's and Gemma 4's per-layer inputs, made once per step for every layer
        self.per_layer_inputs = (
            PerLayerInputs(cfg, ctx) if per_layer_shape(cfg) is not None else None
        )
        # a layer whose shared block another layer holds uses that layer's weights
        for block in self.layers:
            owner = getattr(block.token_mixer, "shares_with", None)
            if owner is not None:
                tie_parameters(block.token_mixer.shared, self.layers[owner].token_mixer.shared)
        # a looped model's later passes run the stored layers again: their weights, each layer its
        # own cache
        for i, owner in self.loop.tied.items():
            tie_parameters(self.layers[i], self.layers[owner])
        for i, (stack, j) in enumerate(self.loop.held):
            tie_parameters(self.layers[i], self.stacks[stack][j])
        final_offset = cfg.norm_offset if cfg.final_norm_offset is None else cfg.final_norm_offset
        self.final_norm = (
            Norm(
                cfg.hidden_size,
                cfg.norm_eps,
                cfg.norm_kind,
                cfg.norm_bias,
                final_offset,
                affine=cfg.norm_affine,
                scale_f32=cfg.norm_scale_f32,
                groups=cfg.norm_groups,
            )
            if last or self.loop.ends
            else None
        )
        self.hc_head = HyperHead(cfg) if cfg.hyper_streams and last else None
        self.lm_head = (
            VocabHead(
                cfg.vocab_size,
                cfg.hidden_size,
                ctx,
                cfg.lm_head_bias,
                self.embed if cfg.tie_word_embeddings else None,
            )
            if last
            else None
        )
        self.tables = RotaryTables(cfg.max_position)
        self.hooks: dict[int, list[Hook]] = {}
        # seconds spent waiting for the previous stage (bench/pipeline.py reads it)
        self.stage_wait_s = 0.0
        self.compiled: CompiledLayers | None = None  # set by compile_layers

    def elsewhere(self, param: str) -> bool:
        """Whether parameter `param` (the decoder's name) belongs to another pipeline stage: its
        tensor is not read here."""
        if self.ctx.pp_size == 1:
            return False
        top, _, rest = param.partition(".")
        if top == "layers":
            return isinstance(self.layers[int(rest.partition(".")[0])], Elsewhere)
        firsts_and_lasts = ("embed", "ngram", "pos_embed", "embed_norm", "final_norm", "lm_head")
        return top in firsts_and_lasts and getattr(self, top) is None

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
        """Call hook(residual) after `layer`; a returned tensor replaces the residual. Returns a
        remover."""
        if not 0 <= layer < self.cfg.num_layers:
            raise IndexError(f"layer {layer} is outside the model's {self.cfg.num_layers} layers")
        self.hooks.setdefault(layer, []).append(hook)
        return lambda: self.hooks[layer].remove(hook)

    def compile_layers(self) -> str | None:
        """Run the layers through compiled graphs from now on (model/compiled.py); returns why not
        instead where they cannot be."""
        reason = why_eager(self)
        if reason is None and self.compiled is None:
            self.compiled = CompiledLayers(self)
        return reason

    # -- forward --------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None) -> KVCache:
        shapes = [getattr(block.token_mixer, "kv_shape", None) for block in self.layers]
        return KVCache(shapes, batch, capacity, dtype or self.dtype, self.device)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor | None:
        """Logits [batch, seq (or 1), vocab] for token ids [batch, seq]; None on a pipeline stage
        but the last, which hands its output on instead. positions and valid are the host's
        (model/host.py); ids may lie on either side (a decode's are the last step's sampled tokens,
        on the device)."""
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
        if valid is None:
            valid = torch.ones(ids.shape, dtype=torch.bool)
        step = StepState(
            positions, valid, self.tables, cache, self.cfg.bidirectional_prompt, self.device
        )
        h = self._stage(upload(ids, self.device), step.positions, step)
        if h is None:
            return None
        if last_only:
            h = h[:, -1:]
        return self._logits(h)

    def final_hidden(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The final norm's output [batch, seq, hidden] for right-padded ids: what the head reads,
        and what a reward head (tune/preference.py) reads instead of it."""
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        step = StepState(positions, valid, self.tables, None, device=self.device)
        h = self._layers(self._embed(ids, step.positions, step), step, ids)
        return self.final_norm(h).to(self.dtype)

    def forward_paged(
        self, ids: torch.Tensor, chunks: list[Chunk], cache: PagedCache, eager: bool = False
    ) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] of each chunk's last token, for ids [tokens]: every chunk's
        new tokens, concatenated in chunk order. Token-wise layers run on the packed tokens; only
        attention splits them by sequence (PagedStep). None on a pipeline stage but the last.
        `eager`: not through compiled layers (a step whose rows carry their own adapters)."""
        step = PagedStep(chunks, cache, self.tables, ids, self.device)
        h = self._stage(upload(ids, self.device).unsqueeze(0), step.positions, step, eager)
        return None if h is None else self._logits(h[:, step.last_tokens])[0]

    def forward_paged_rows(
        self,
        ids: torch.Tensor,
        chunks: list[Chunk],
        cache: PagedCache,
        rows: torch.Tensor,
        eager: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_paged's step, with logits [len(rows), vocab] at the given packed rows and the
        final norm's output over every token [tokens, hidden] (what an MTP draft reads,
        model/mtp.py). One stage only."""
        step = PagedStep(chunks, cache, self.tables, ids, self.device)
        h = self._stage(upload(ids, self.device).unsqueeze(0), step.positions, step, eager)
        normed = self.final_norm(h).to(self.dtype)[0]
        return self.head_logits(normed[rows]), normed

    def _stage(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepState | PagedStep,
        eager: bool = False,
    ) -> torch.Tensor | None:
        """This stage's layers over the embedding (the first stage) or the previous stage's output;
        the output goes on to the next stage (None here) or, on the last, is returned for the
        head."""
        ctx = self.ctx
        if ctx.first_stage:
            h = self._embed(ids, positions, step)
        else:  # the residual stream: f32 where the model keeps it so (residual_fp32)
            dtype = torch.float32 if self.cfg.residual_fp32 else self.dtype
            waited = time.perf_counter()
            h = ctx.recv_prev((*ids.shape, self.cfg.hidden_size), dtype, self.device)
            # the pipeline's bubble, as this stage sees it
            self.stage_wait_s += time.perf_counter() - waited
        h = self._layers(h, step, ids) if eager else self._run_layers(h, step, ids)
        if ctx.last_stage:
            return h
        ctx.send_next(h)
        return None

    def _embed(
        self, ids: torch.Tensor, positions: torch.Tensor, step: StepState | PagedStep
    ) -> torch.Tensor:
        h = self.embed(ids)
        if self.ngram is not None:  # the step carries each sequence's last tokens across steps
            h = self.ngram(ids, h, step)
        if self.cfg.embed_scale != 1.0:
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        if self.pos_embed is not None:
            h = h + self.pos_embed.weight[positions + self.cfg.position_offset]
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        return h

    def _run_layers(
        self, h: torch.Tensor, step: StepState | PagedStep, ids: torch.Tensor
    ) -> torch.Tensor:
        """The layers through their compiled graphs where they are compiled and no hook reads them,
        else eagerly. A layer that cannot be compiled turns compiling off for good; its step runs
        again eagerly (every key it wrote goes to the same slots again)."""
        if self.compiled is None or any(self.hooks.values()):
            return self._layers(h, step, ids)
        stream = self._into_stream(h, step, ids)
        try:
            out = self.compiled.run(stream, step)
            return self.altup.collapse(out) if self.altup is not None else out
        except failures() as error:
            self.compiled.stop()
            self.compiled = None
            progress(
                f"compiling the step failed ({str(error).strip().splitlines()[0][:200]}); "
                "running eagerly from now on"
            )
            return self._layers(h, step, ids)

    def _into_stream(
        self, h: torch.Tensor, step: StepState | PagedStep, ids: torch.Tensor
    ) -> torch.Tensor:
        """The stream the layers take from the embedding h, eager or compiled: AltUp's copies of h
        (Gemma 3n) or h itself; first the step is given every layer's own input (Gemma 3n, Gemma 4's
        E models)."""
        if self.per_layer_inputs is not None:
            step.per_layer_inputs = self.per_layer_inputs(ids, h)
        return self.altup.expand(h) if self.altup is not None else h

    def _layers(
        self, h: torch.Tensor, step: StepState | PagedStep, ids: torch.Tensor
    ) -> torch.Tensor:
        # the embedding output, which Zamba2's shared blocks read beside the hidden state
        step.embeddings = h
        step.token_ids = ids  # what hash-routed experts choose by (DeepSeek-V4)
        h = self._into_stream(h, step, ids)
        # block skip connections (Solar Pro): each slot's last kept state
        kept: dict[int, torch.Tensor] = {}
        if self.cfg.hyper_streams:
            h = spread(h, self.cfg.hyper_streams)
        # a looped model's states (HRM-Text's high one from the embedding, its low one from
        # loop_init)
        states = {0: h}
        if self.loop_init is not None:
            states[1] = self.loop_init.weight.to(h.dtype).expand_as(h)
        for i in range(*self.stage):
            block = self.layers[i]
            if self.cfg.block_skips:
                h = self._skip(i, h, kept)
            # a pass of a looped model of several states begins on their sum
            if i in self.loop.reads:
                first, *rest = self.loop.reads[i]
                h = states[first]
                for state in rest:
                    h = h + states[state]
            h = block(h, step)
            if i in self.loop.ends:
                h = self.final_norm(h)
            for hook in self.hooks.get(i, ()):
                h = self._hooked(hook, h)
            if i in self.loop.writes:
                states[self.loop.writes[i]] = h
        if self.altup is not None:
            return self.altup.collapse(h)
        return self.hc_head(h) if self.hc_head is not None else h

    def _hooked(self, hook: Hook, h: torch.Tensor) -> torch.Tensor:
        """h after `hook`, which reads (and may replace) the residual stream: AltUp's first copy,
        where the stream is its copies; the streams' mean, where they are hyper-connected
        (model/hyper_connection.py)."""
        if self.cfg.hyper_streams:
            return hooked(h, hook)
        replaced = hook(h[0] if self.altup is not None else h)
        if replaced is None:
            return h
        return torch.cat((replaced.unsqueeze(0), h[1:])) if self.altup is not None else replaced

    def _skip(self, layer: int, h: torch.Tensor, kept: dict[int, torch.Tensor]) -> torch.Tensor:
        """Before `layer`: every skip keeping here keeps h, then every skip mixing here mixes its
        kept state in. Token-wise, so the cached and paged reads match the whole one."""
        for slot, (keep, _, _) in enumerate(self.cfg.block_skips):
            if layer in keep:
                kept[slot] = h
        for slot, (_, mix, weight) in enumerate(self.cfg.block_skips):
            if layer in mix:
                h = kept[slot] * weight + h * (1 - weight)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        # an f32 residual stream (residual_fp32) meets the head in the model's dtype, as
        # Transformers casts it
        return self.head_logits(self.final_norm(h).to(self.dtype))

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The head over final-norm outputs (also an MTP layer's that scores with the model's head,
        model/mtp.py)."""
        logits = self.lm_head(normed)
        if self.cfg.logit_multiplier != 1.0:
            logits = logits * self.cfg.logit_multiplier
        if self.cfg.logit_softcap is not None:
            logits = torch.tanh(logits / self.cfg.logit_softcap) * self.cfg.logit_softcap
        if self.cfg.scored_vocab is not None:  # the head's rows past it are padding (Inkling)
            logits = logits[..., : self.cfg.scored_vocab]
        return logits


def meta_decoder(
    cfg: ModelConfig, ctx: ParallelCtx = SINGLE, dtype: torch.dtype = torch.float32
) -> Decoder:
    """The decoder's shapes only, on the meta device: what the loader allocates and fills, and what
    a writer walks for parameter names. Cast while shapes only, so nothing is allocated twice."""
    with torch.device("meta"):
        return Decoder(cfg, ctx).to(dtype)
