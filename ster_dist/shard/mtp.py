"""Loading a model's MTP layer (model/mtp.py) on a rank that holds the model already: the same checkpoint read
again through a name map that adds the layer's own tensors, every tensor of the model proper skipped (the
decoder holds it), the layer's copy of the embedding never read (the decoder's is shared)."""

from __future__ import annotations

import dataclasses

import torch

from ster_dist.errors import Refusal
from ster_dist.load import LoadedModel, open_source
from ster_dist.model.mtp import MTPDraft, mtp_config, mtp_rules
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import FusedColumns
from ster_dist.shard.loader import fill_module


def load_mtp(loaded: LoadedModel, ctx: ParallelCtx) -> MTPDraft:
    """This rank's share of the model's first MTP layer, in the decoder's dtype and on its device."""
    cfg = loaded.cfg
    if not cfg.mtp_layers:
        raise Refusal(f"{loaded.checkpoint.model} has no MTP layers (num_nextn_predict_layers); speculative "
                      "decoding with --speculative mtp needs a model that publishes them (DeepSeek-V3, R1)")
    if loaded.checkpoint.weight_format != "safetensors":
        raise Refusal(f"MTP layers load from Transformers' safetensors layout, not {loaded.checkpoint.weight_format}; "
                      "drop --speculative")
    ext = mtp_config(cfg, loaded.checkpoint.raw_config)
    index = cfg.num_layers
    spec = dataclasses.replace(ext.spec, rules=ext.spec.rules + mtp_rules(),
                               ignore=ext.spec.ignore + (rf"model\.layers\.{index}\.embed_tokens\.weight",))
    dtype = loaded.model.dtype
    with torch.device("meta"):
        draft = MTPDraft(ext, ctx, index).to(dtype)
    source = open_source(loaded.checkpoint, dtype, ext)
    try:
        fill_module(draft, ext, source, loaded.model.device, loaded.weights == "fp8", spec=spec)
    finally:
        source.close()
    done: dict = {}
    for module in draft.modules():  # q/k/v and gate/up as one product each, as the decoder's (Decoder.fuse_projections)
        if isinstance(module, FusedColumns):
            module.fuse(done)
    return draft.eval()
