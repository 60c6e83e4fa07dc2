"""Multi-token-prediction (MTP) layers, as a draft model over the decoder they follow.

DeepSeek-V3's MTP layer k (stored as layer num_layers + k: enorm, hnorm, eh_proj, a whole decoder
layer, shared_head.norm and shared_head.head; its embed_tokens is a copy of the model's, never read)
predicts token t+2 from the model's hidden state at t and the embedding of token t+1:

    x = eh_proj([enorm(embed(t+1)); hnorm(h_t)]);  y = block(x);  logits =
    shared_head.head(shared_head.norm(y))

GLM-4.5 stores and runs its layer the same way. MiMo's (model.mtp_layers.{k}: token_layernorm,
hidden_layernorm, input_proj, a Qwen2 block, final_layernorm) reads [h; e] in that order, ends in
its final_layernorm and scores with the model's own lm_head (vLLM's mimo_mtp); the family's MTPSpec
(families/spec.py) says which. Here the parts keep DeepSeek's names whatever the checkpoint calls
them.

h_t is the model's final-norm output (what its head reads), as vLLM reads it, and the embedding of
the row at position 0 is zeroed, as vLLM and SGLang run the layer; chaining a second draft feeds the
layer's output back as h (after the out norm where the layer ends in it, MiMo). The layer is sharded
like any decoder layer (its Block built with the same ParallelCtx) and keeps its own paged cache:
`layers` lists num_layers absent layers before it, so its attention writes the cache slot of its own
index, and PagedCache sizes only its keys. Only the first MTP layer drafts (DeepSeek-V3 publishes
one); later ones are refused where the config states them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.config import ModelConfig, from_hf
from ster_dist.config.file import wrapper_of
from ster_dist.errors import Refusal
from ster_dist.families.spec import MTPSpec, Rule
from ster_dist.model.anchored import Anchored
from ster_dist.model.block import Block
from ster_dist.model.decoder import Decoder, Elsewhere
from ster_dist.model.host import upload
from ster_dist.model.norm import Norm
from ster_dist.model.paged import Chunk, PagedCache
from ster_dist.model.paged_step import PagedStep
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import Replicated, VocabHead, module_shards


def mtp_rules(mtp: MTPSpec) -> tuple[Rule, ...]:
    """The MTP layer's own tensors, as the loader presents them (at model.layers.{i}, shard/mtp.py),
    under the family's part names; its decoder layer's follow the family's rules at index {i}."""
    parts = {
        "enorm": mtp.token_norm,
        "hnorm": mtp.hidden_norm,
        "eh_proj": mtp.proj,
        "shared_head_norm": mtp.out_norm,
        "shared_head_head": mtp.head,
    }
    return tuple(
        Rule(f"model.layers.{{i}}.{stored}.weight", f"mtp.{{i}}.{ours}.weight")
        for ours, stored in parts.items()
        if stored is not None
    )


# per-layer lists a config states for its decoder layers, and what the MTP layer is in each: full
# attention and
# (where the family states its feed-forwards so) sparse, as vLLM builds the layer past the decoder's
_MTP_LAYER_KINDS = {"layer_types": "full_attention", "mlp_layer_types": "sparse"}


def mtp_config(cfg: ModelConfig, raw: dict) -> ModelConfig:
    """The model's config read with its MTP layer counted as a decoder layer, so that the layer's
    kinds, rotation and experts are those its index states (DeepSeek-V3's: latent attention and
    routed experts)."""
    if cfg.mtp_layers != 1:
        raise Refusal(
            f"the config states {cfg.mtp_layers} MTP layers; speculative decoding drafts with exactly one "
            "(DeepSeek-V3's num_nextn_predict_layers 1)"
        )
    # a wrapper's counts live in its text_config (config_file.text_config), which is what from_hf
    # reads
    wrapped = wrapper_of(raw) is not None
    text = raw["text_config"] if wrapped else raw
    counted = {
        "num_hidden_layers": cfg.num_layers + 1,
        "num_nextn_predict_layers": 0,
        **{
            key: [*text[key], kind]
            for key, kind in _MTP_LAYER_KINDS.items()
            if isinstance(text.get(key), list) and len(text[key]) == cfg.num_layers
        },
    }
    read = {**raw, "text_config": {**text, **counted}} if wrapped else {**raw, **counted}
    return dataclasses.replace(from_hf(read), eos_token_ids=cfg.eos_token_ids)


class _Head(nn.Module):
    """One MTP layer's own parameters around its decoder layer."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx):
        super().__init__()
        hidden = cfg.hidden_size

        def norm():
            return Norm(hidden, cfg.norm_eps, cfg.norm_kind, cfg.norm_bias, cfg.norm_offset)

        self.enorm, self.hnorm, self.shared_head_norm = norm(), norm(), norm()
        # small next to the layer: every rank holds it whole
        self.eh_proj = Replicated((hidden, 2 * hidden))
        # a head of its own, or (MiMo) the model's
        self.shared_head_head = (
            VocabHead(cfg.vocab_size, hidden, ctx, False, None) if cfg.spec.mtp.head else None
        )


class MTPDraft(Anchored):
    """The first MTP layer of a model on this rank; `main` (the loaded Decoder) lends its embedding
    and rotary tables. forward_paged runs it over a packed step like the decoder's."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx, index: int):
        super().__init__()
        self.cfg, self.ctx, self.index = cfg, ctx, index
        self.layers = nn.ModuleList([Elsewhere() for _ in range(index)] + [Block(cfg, index, ctx)])
        self.mtp = nn.ModuleDict({str(index): _Head(cfg, ctx)})
        self._names: frozenset[str] | None = None

    def elsewhere(self, param: str) -> bool:
        """The model's own tensors (its layers, embedding, norm and head) are the decoder's: not
        read here."""
        if self._names is None:
            self._names = frozenset(module_shards(self))
        return param not in self._names

    def new_cache(self, num_blocks: int, block_size: int) -> PagedCache:
        return PagedCache(self, num_blocks, block_size)

    def forward_paged(
        self,
        main: Decoder,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        chunks: list[Chunk],
        cache: PagedCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output [tokens, hidden], logits [len(chunks), vocab] at each chunk's last
        token) for packed ids [tokens] (token t+1 of each position) and hidden [tokens, hidden] (h_t
        there)."""
        head, layout = self.mtp[str(self.index)], self.cfg.spec.mtp
        step = PagedStep(chunks, cache, main.tables, ids, main.device)
        ids = upload(ids, main.device)
        # the row of position 0 reads no embedding, as DeepSeek's MTP layers are run (vLLM, SGLang
        # mask it too)
        e = head.enorm(main.embed(ids).masked_fill((step.positions[0] == 0).unsqueeze(-1), 0))
        h = head.hnorm(hidden.to(e.dtype))
        x = F.linear(torch.cat((h, e) if layout.hidden_first else (e, h), -1), head.eh_proj.weight)
        y = self.layers[self.index](x.unsqueeze(0), step)[0]
        if layout.chain_normed:  # the out norm ends the layer: the chain reads its output
            y = head.shared_head_norm(y).to(self.dtype)
            last = y[step.last_tokens]
        else:
            last = head.shared_head_norm(y[step.last_tokens]).to(self.dtype)
        logits = (
            head.shared_head_head(last)
            if head.shared_head_head is not None
            else main.head_logits(last)
        )
        return y, logits
