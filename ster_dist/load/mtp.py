"""Loading a model's MTP layer (model/mtp.py) on a rank that holds the model already: the same
checkpoint read again through a name map that adds the layer's own tensors, every tensor of the
model proper skipped (the decoder holds it), the layer's copy of the embedding never read (the
decoder's is shared). A family that stores the layer apart from the decoder's (MiMo's
model.mtp_layers.{k}) has its tensors presented at the index the layer runs as
(model.layers.{num_hidden_layers + k}), so one name map serves every layout."""

from __future__ import annotations

import dataclasses

import torch

from ster_dist.errors import Refusal
from ster_dist.load.model_loader import LoadedModel, open_source
from ster_dist.model.mtp import MTPDraft, mtp_config, mtp_rules
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import FusedColumns
from ster_dist.shard.loader import fill_module, read_window
from ster_dist.shard.source import TensorSource


def load_mtp(loaded: LoadedModel, ctx: ParallelCtx) -> MTPDraft:
    """This rank's share of the model's first MTP layer, in the decoder's dtype and on its
    device."""
    cfg = loaded.cfg
    if not cfg.mtp_layers:
        raise Refusal(
            f"{loaded.checkpoint.model} has no MTP layers (num_nextn_predict_layers); speculative "
            "decoding with --speculative mtp needs a model that publishes them (DeepSeek-V3, R1, "
            "GLM-4.5, MiMo)"
        )
    if loaded.checkpoint.weight_format != "safetensors":
        raise Refusal(
            f"MTP layers load from Transformers' safetensors layout, not {loaded.checkpoint.weight_format}; "
            "drop --speculative"
        )
    ext = mtp_config(cfg, loaded.checkpoint.raw_config)
    index, layout = cfg.num_layers, ext.spec.mtp
    spec = dataclasses.replace(
        ext.spec,
        rules=ext.spec.rules + mtp_rules(layout),
        ignore=ext.spec.ignore + (rf"model\.layers\.{index}\.embed_tokens\.weight",),
    )
    dtype = loaded.model.dtype
    with torch.device("meta"):
        draft = MTPDraft(ext, ctx, index).to(dtype)
    source = open_source(loaded.checkpoint, dtype, ext)
    stored, presented = layout.prefix.format(i=index, k=0), f"model.layers.{index}."
    # stored apart from the decoder's layers: presented where the layer runs
    if stored != presented:
        source = Renamed(source, stored, presented)
    try:
        fill_module(draft, ext, source, loaded.model.device, loaded.weights == "fp8", spec=spec)
    finally:
        source.close()
    done: dict = {}
    # q/k/v and gate/up as one product each, as the decoder's (Decoder.fuse_projections)
    for module in draft.modules():
        if isinstance(module, FusedColumns):
            module.fuse(done)
    return draft.eval()


def _swap(name: str, old: str, new: str) -> str:
    """name with the prefix `old` made `new`, at its start or below a wrapper's prefix
    (language_model.)."""
    at = name.find(old)
    return (
        name[:at] + new + name[at + len(old) :]
        if at == 0 or (at > 0 and name[at - 1] == ".")
        else name
    )


class Renamed:
    """A TensorSource whose tensors named `stored`... (below any wrapper's prefix) are presented as
    `presented`...;
    the rest as they are."""

    def __init__(self, source: TensorSource, stored: str, presented: str):
        self.source, self._stored, self._presented = source, stored, presented
        # an FP8 source kept as FP8 (--weights fp8): its maps by presented name
        if hasattr(source, "scales"):
            self.scales = {self._shown(n): s for n, s in source.scales.items()}
        if hasattr(source, "blocks"):
            self.blocks = {self._shown(n): b for n, b in source.blocks.items()}

    def _shown(self, name: str) -> str:
        return _swap(name, self._stored, self._presented)

    def _real(self, name: str) -> str:
        return _swap(name, self._presented, self._stored)

    def names(self) -> list[str]:
        return [self._shown(n) for n in self.source.names()]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(self._real(name))

    def dtype(self, name: str) -> torch.dtype:
        return self.source.dtype(self._real(name))

    def read(self, name: str, rows=None, cols=None) -> torch.Tensor:
        return self.source.read(self._real(name), rows, cols)

    def read_into(self, name: str, out: torch.Tensor, rows=None, cols=None) -> bool:
        read_into = getattr(self.source, "read_into", None)
        return read_into is not None and read_into(self._real(name), out, rows, cols)

    def read_window(self, name: str, window: tuple[slice, ...]) -> torch.Tensor:
        return read_window(self.source, self._real(name), window)

    def read_kept(self, name: str, window):
        return self.source.read_kept(self._real(name), window)

    @property
    def dtype_out(self):
        return self.source.dtype_out

    def close(self) -> None:
        self.source.close()
