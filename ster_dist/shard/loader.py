"""The streaming loader: allocate a model built on the meta device, then fill each parameter
with this rank's rows, read one slice at a time through a TensorSource.

The loader knows no model class: it is given the module (its caller builds it) and reads each
parameter's Shard from the module's ShardedModules, so weight I/O sits above the model and the
model never imports it. A rank never reads another rank's rows or experts; every checkpoint
tensor must be consumed (or ignored by rule, or held by another rank) and every parameter filled,
or loading fails naming it.

With `keep_fp8` (`--weights fp8`) the parameters shard/fp8_kept.py keeps are allocated as
float8_e4m3fn and filled with the stored bytes of the same windows, their covering scale entries
gathered beside them. With
`keep_blocks` a .gguf's Q8_0/Q4_0/Q4_1 tensors fill the parameters shard/ggml_kept.py keeps with
their stored bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.parallel.fp8 import FP8
from ster_dist.parallel.linear import fused_runs, module_shards, tied_parameters
from ster_dist.shard.arena import allocate
from ster_dist.shard.fp8_kept import ScaleGrid, kept_parameters, span_of
from ster_dist.shard.ggml_kept import allocate_kept, fill_kept, kept_blocks, mark_kept
from ster_dist.shard.plan import Piece, Plan, build_plan
from ster_dist.shard.source import TensorSource


def fill_module(
    model: nn.Module,
    cfg: ModelConfig,
    source: TensorSource,
    device: str | torch.device = "cpu",
    keep_fp8: bool = False,
    spec=None,
    keep_blocks: bool = False,
) -> Plan:
    """Allocate `model` on `device` (built on the meta device: shapes only) and fill every parameter
    from `source` through cfg's name map; returns the plan it read by. `keep_fp8`: a quantized
    source's FP8 tensors stay FP8 where the module docstring says. `spec`: a name map in place of
    the family's (an MTP layer's, shard/mtp.py). `keep_blocks`: a .gguf source's Q8_0/Q4_0/Q4_1
    tensors stay in their blocks."""
    shards = module_shards(model)
    # a tied copy (a tensor several layers use) is listed once, under its first name; the copies are
    # dropped
    # before allocating and given the filled tensor after, so it is read once and held once
    copies = tied_parameters(model)
    for module, attr, _, _ in copies:
        module._parameters[attr] = None
    shapes = {name: source.shape(name) for name in source.names()}
    spec = spec or cfg.spec
    plan = build_plan(
        spec,
        cfg,
        shards,
        shapes,
        tied_copies={name for _, _, name, _ in copies},
        elsewhere=getattr(model, "elsewhere", None),
    )
    kept = {}
    if keep_fp8:
        # Fp8Source: quantized tensor -> its scale tensor
        quantized = set(getattr(source, "scales", {}))
        tied = {name for _, _, name, _ in copies} | {owner for _, _, _, owner in copies}
        kept = kept_parameters(model, plan, shapes, quantized, tied)
    blocks = {}
    if keep_blocks and hasattr(source, "read_blocks"):
        tied = {name for _, _, name, _ in copies} | {owner for _, _, _, owner in copies}
        blocks = kept_blocks(model, plan, shapes, source, tied)
        allocate_kept(model, blocks, {name: shards[name].local_shape() for name in blocks})
    modules = dict(model.named_modules())
    # still on the meta device: allocated below as FP8, never at the compute dtype
    for name in kept:
        prefix, _, attr = name.rpartition(".")
        modules[prefix]._parameters[attr] = nn.Parameter(
            torch.empty(shards[name].local_shape(), dtype=FP8, device="meta"), requires_grad=False
        )
    # in place: parameters allocated, not initialised (every one is filled below); on the CPU in one
    # block
    allocate(model, device, fused_runs(model))
    grids = {
        name: ScaleGrid(spans, source.blocks, shards[name].local_shape(), device)
        for name, spans in kept.items()
    }
    params = dict(model.named_parameters())
    for module, attr, _, owner in copies:
        module._parameters[attr] = params[owner]
    missing = [name for name in shards if name not in plan.expected]
    if missing:
        raise Refusal(
            f"parameter {missing[0]} is filled by no checkpoint tensor ({len(missing)} in all: "
            f"{', '.join(missing[:5])}); the weights lack tensors the config implies"
        )
    for name, shard in shards.items():
        if shard.pad_to is not None:  # vocabulary padding rows are never read; keep them zero
            params[name].data[sum(b - a for a, b in shard.ranges) :].zero_()
    stacked_rows: dict[str, int] = {}
    last: tuple = (None, None)  # GPT-OSS's interleaved gate and up share one window: read it once
    for read in plan.reads:
        target = params[read.param].data
        if read.param in blocks:
            kind, spans = blocks[read.param]
            fill_kept(source, target, kind, [(n, s) for n, s in spans if n == read.source])
            continue
        if read.param in grids:
            _fill_kept(
                source, read.source, read.pieces, target, grids[read.param], shapes[read.source]
            )
            if read.stacked:
                stacked_rows[read.param] = stacked_rows.get(read.param, 0) + 1
            continue
        for piece in read.pieces:
            if piece.window is not None:
                key = (read.source, piece.window)
                data = last[1] if last[0] == key else read_window(source, read.source, piece.window)
                last = (key, data)
                target[piece.dst] = _arrange(data, piece)
                continue
            if (
                not piece.transpose
                and hasattr(source, "read_into")
                and source.read_into(read.source, target[piece.dst], piece.rows, piece.cols)
            ):
                continue
            data = source.read(read.source, piece.rows, piece.cols)
            if piece.transpose:
                data = data.t()
            target[piece.dst] = data
        if read.stacked:
            stacked_rows[read.param] = stacked_rows.get(read.param, 0) + 1
    for name, count in stacked_rows.items():
        if count != params[name].shape[0]:
            raise Refusal(
                f"parameter {name} has {params[name].shape[0]} stacked rows but the checkpoint "
                f"fills {count}; the weights lack some of its tensors"
            )
    if blocks:  # they compute in the dtype the source dequantizes the rest to
        mark_kept(
            model, blocks, {name: shards[name].local_shape() for name in blocks}, source.precision
        )
    for name, grid in grids.items():
        prefix, _, attr = name.rpartition(".")
        rows, cols = grid.sizes()
        modules[prefix].keep_fp8(attr, grid.scale, rows, cols, source.dtype_out)
    return plan


def _fill_kept(
    source: TensorSource,
    name: str,
    pieces: tuple[Piece, ...],
    target: torch.Tensor,
    grid: ScaleGrid,
    shape: tuple[int, ...],
) -> None:
    """A kept parameter's pieces: the FP8 bytes into the parameter, the covering scale entries into
    its grid."""
    for piece in pieces:
        span = span_of(piece, shape, tuple(target.shape))
        values, entries = source.read_kept(name, span.window)
        target[piece.dst] = values
        grid.put(span, source.blocks[name], entries)


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
