"""The streaming loader: allocate a model built on the meta device, then fill each parameter
with this rank's rows, read one slice at a time through a TensorSource.

The loader knows no model class: it is given the module (its caller builds it) and reads each
parameter's Shard from the module's ShardedModules, so weight I/O sits above the model and the
model never imports it. A rank never reads another rank's rows or experts; every checkpoint
tensor must be consumed (or ignored by rule, or held by another rank) and every parameter filled,
or loading fails naming it.
"""

from __future__ import annotations

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.parallel.linear import module_shards, tied_parameters
from ster_dist.shard.plan import Piece, Plan, build_plan
from ster_dist.shard.source import TensorSource


def fill_module(model: nn.Module, cfg: ModelConfig, source: TensorSource,
                device: str | torch.device = "cpu") -> Plan:
    """Allocate `model` on `device` (built on the meta device: shapes only) and fill every parameter
    from `source` through cfg's name map; returns the plan it read by."""
    shards = module_shards(model)
    # a tied copy (a tensor several layers use) is listed once, under its first name; the copies are dropped
    # before allocating and given the filled tensor after, so it is read once and held once
    copies = tied_parameters(model)
    for module, attr, _, _ in copies:
        module._parameters[attr] = None
    model.to_empty(device=device)  # in place: parameters allocated, not initialised; every one is filled below
    shapes = {name: source.shape(name) for name in source.names()}
    plan = build_plan(cfg.spec, cfg, shards, shapes, tied_copies={name for _, _, name, _ in copies})
    params = dict(model.named_parameters())
    for module, attr, _, owner in copies:
        module._parameters[attr] = params[owner]
    missing = [name for name in shards if name not in plan.expected]
    if missing:
        raise Refusal(f"parameter {missing[0]} is filled by no checkpoint tensor ({len(missing)} in all: "
                      f"{', '.join(missing[:5])}); the weights lack tensors the config implies")
    for name, shard in shards.items():
        if shard.pad_to is not None:  # vocabulary padding rows are never read; keep them zero
            params[name].data[sum(b - a for a, b in shard.ranges):].zero_()
    stacked_rows: dict[str, int] = {}
    last: tuple = (None, None)  # GPT-OSS's interleaved gate and up share one window: read it once
    for read in plan.reads:
        target = params[read.param].data
        for piece in read.pieces:
            if piece.window is not None:
                key = (read.source, piece.window)
                data = last[1] if last[0] == key else read_window(source, read.source, piece.window)
                last = (key, data)
                target[piece.dst] = _arrange(data, piece)
                continue
            if not piece.transpose and hasattr(source, "read_into") and \
                    source.read_into(read.source, target[piece.dst], piece.rows, piece.cols):
                continue
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


def _arrange(data: torch.Tensor, piece: Piece) -> torch.Tensor:
    if piece.take is not None:
        axis, start, step = piece.take
        index = [slice(None)] * data.dim()
        index[axis] = slice(start, None, step)
        data = data[tuple(index)]
    return data.transpose(-1, -2) if piece.transpose else data


def read_window(source: TensorSource, name: str, window: tuple[slice, ...]) -> torch.Tensor:
    """A block of an N-d tensor (one slice per leading dimension): stacked experts are [experts,
    rows, cols]. Sources that can read a block directly do (safetensors: only its bytes); others
    read the leading rows and cut the rest in memory."""
    shape = source.shape(name)
    window = tuple(window) + (slice(None),) * (len(shape) - len(window))
    if len(shape) <= 2:
        return source.read(name, window[0], window[1] if len(shape) == 2 else None)
    if hasattr(source, "read_window"):
        return source.read_window(name, window)
    return source.read(name, window[0])[(slice(None), *window[1:])]
