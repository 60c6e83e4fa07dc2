"""The streaming loader: build the decoder on the meta device, then fill each parameter
with this rank's rows, read one slice at a time through a TensorSource.

A rank never reads another rank's rows; every checkpoint tensor must be consumed
(or ignored by rule) and every parameter filled, or loading fails naming it.
"""

from __future__ import annotations

import torch

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.model.decoder import Decoder
from ster_dist.shard.ctx import SINGLE, ParallelCtx
from ster_dist.shard.plan import Plan, build_plan
from ster_dist.shard.source import TensorSource


def build_decoder(cfg: ModelConfig, ctx: ParallelCtx = SINGLE, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> Decoder:
    """An empty decoder: shapes only, parameters allocated but not initialised."""
    with torch.device("meta"):
        model = Decoder(cfg, ctx)
    model.to_empty(device=device)
    return model.to(dtype)


def load_into(model: Decoder, source: TensorSource) -> Plan:
    cfg = model.cfg
    shards = model.shards()
    shapes = {name: source.shape(name) for name in source.names()}
    plan = build_plan(cfg.spec, cfg, shards, shapes)
    params = dict(model.named_parameters())
    missing = [name for name in shards if name not in plan.expected]
    if missing:
        raise Refusal(f"parameter {missing[0]} is filled by no checkpoint tensor ({len(missing)} in all: "
                      f"{', '.join(missing[:5])}); the weights lack tensors the config implies")
    for name, shard in shards.items():
        if shard.pad_to is not None:
            params[name].data.zero_()  # vocabulary padding rows are never read; keep them zero
    stacked_rows: dict[str, int] = {}
    for read in plan.reads:
        target = params[read.param].data
        for piece in read.pieces:
            data = source.read(read.source, piece.rows, piece.cols)
            if piece.transpose:
                data = data.t()
            target[piece.dst] = data
        if read.stacked:
            stacked_rows[read.param] = stacked_rows.get(read.param, 0) + 1
    for name, count in stacked_rows.items():
        if count != params[name].shape[0]:
            raise Refusal(f"parameter {name} has {params[name].shape[0]} stacked rows but the checkpoint "
                          f"fills {count}; the weights lack some of its tensors")
    return plan


def load_decoder(cfg: ModelConfig, source: TensorSource, ctx: ParallelCtx = SINGLE,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Decoder:
    model = build_decoder(cfg, ctx, dtype, device)
    load_into(model, source)
    model.eval()
    return model
