"""What one rank of a tp x ep run holds and reads, from a checkpoint's tensor names, dtypes and shapes
alone (its safetensors headers): no weight byte is read.

The rank's decoder is built on the meta device with that rank's ParallelCtx and the real shard plan
(shard/plan.py) is run over the headers' shapes, exactly as the loader runs it, so the figures are
the loader's, not a formula's: parameter bytes are what the rank allocates (at the compute dtype,
vocabulary padding included), read bytes are the windows its pieces read, in the files' dtypes.

Two kinds of checkpoint tensor are set aside before the plan sees them:
- multi-token-prediction layers (config `num_nextn_predict_layers`: `model.layers.{N..}` past the
  decoder's layers), which plain decoding never reads; they are counted apart;
- FP8 block scales (`X.weight_scale_inv` beside a float8 `X.weight`, `quant_method: fp8` with
  `weight_block_size`): a rank reads exactly the scale blocks that cover its slices of X.weight.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.model.decoder import meta_decoder
from ster_dist.model.paged import PagedCache
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import module_shards, tied_parameters
from ster_dist.shard.plan import Piece, build_plan
from ster_dist.shard.safetensors_header import DTYPES

SCALE_SUFFIX = "_scale_inv"  # X.weight_scale_inv holds the inverse scales of X.weight's blocks
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor as its header states it."""

    dtype: str  # the safetensors tag: BF16, F8_E4M3, F32, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class CheckpointTensors:
    """A checkpoint's tensors sorted into what the plan reads, FP8 scales and MTP layers."""

    planned: dict[str, Tensor]
    scales: dict[str, str]  # the weight's name -> its scale tensor's name
    mtp: tuple[str, ...]    # multi-token-prediction tensors, never read by plain decoding
    block: tuple[int, int] | None  # FP8 weight_block_size (rows, columns)
    tensors: dict[str, Tensor]


@dataclass(frozen=True)
class RankFootprint:
    rank: int
    tp_rank: int
    ep_rank: int
    parameter_bytes: int     # what the rank allocates for its parameters at the compute dtype
    read_bytes: int          # what it reads from the files (weights and scales), in the files' dtypes
    scale_bytes: int         # of which FP8 block scales
    kv_bytes_per_token: int  # its paged KV cache per token, all layers, at the compute dtype


def fp8_block(raw: dict) -> tuple[int, int] | None:
    """The block (rows, columns) of a `quant_method: fp8` config; None for an unquantized one. Every
    other quantization is refused: the plan would count bytes it cannot name."""
    quant = raw.get("quantization_config")
    if quant is None and isinstance(raw.get("text_config"), dict):
        quant = raw["text_config"].get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if method == "fp8" and isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        return block[0], block[1]
    raise Refusal(f"quantization_config {method!r}{'' if method != 'fp8' else ' without a weight_block_size'} "
                  "is not planned; ster plan reads unquantized checkpoints and FP8 block-quantized ones "
                  "(quant_method fp8 with weight_block_size)")


def sort_tensors(cfg: ModelConfig, raw: dict, tensors: dict[str, Tensor]) -> CheckpointTensors:
    block = fp8_block(raw)
    nextn = raw.get("num_nextn_predict_layers") or 0
    planned, scales, mtp = {}, {}, []
    for name, tensor in tensors.items():
        layer = _LAYER.match(name)
        if nextn and layer and cfg.num_layers <= int(layer.group(1)) < cfg.num_layers + nextn:
            mtp.append(name)
        elif block is not None and name.endswith(SCALE_SUFFIX):
            weight = name[:-len(SCALE_SUFFIX)]
            if weight not in tensors or not tensors[weight].dtype.startswith("F8"):
                raise Refusal(f"checkpoint tensor {name} scales no float8 tensor {weight}; "
                              "the checkpoint is not FP8 block-quantized as its config says")
            scales[weight] = name
        else:
            planned[name] = tensor
    return CheckpointTensors(planned, scales, tuple(sorted(mtp)), block, tensors)


def _extent(piece: Piece, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """The source ranges one piece reads, one (start, stop) per dimension."""
    if piece.window is not None:
        window = tuple(piece.window) + (slice(None),) * (len(shape) - len(piece.window))
        return [w.indices(n)[:2] for w, n in zip(window, shape)]
    out = [(0, n) for n in shape]
    if piece.rows is not None and shape:
        out[0] = piece.rows.indices(shape[0])[:2]
    if piece.cols is not None and len(shape) >= 2:
        out[1] = piece.cols.indices(shape[1])[:2]
    return out


def _scale_blocks(extents: list[list[tuple[int, int]]], scale: Tensor, block: tuple[int, int]) -> int:
    """How many scale entries cover the given windows of the weight (its last two dims blocked)."""
    def blocked(extent):
        lead = extent[:-2]
        (r0, r1), (c0, c1) = extent[-2:]
        return lead + [(r0 // block[0], -(-r1 // block[0])), (c0 // block[1], -(-c1 // block[1]))]

    spans = [blocked(e) for e in extents if all(b > a for a, b in e)]
    if len(spans) == 1:
        return math.prod(b - a for a, b in spans[0])
    grid = torch.zeros(scale.shape, dtype=torch.bool)  # pieces of one weight may share blocks
    for span in spans:
        grid[tuple(slice(a, b) for a, b in span)] = True
    return int(grid.sum())


def rank_footprint(cfg: ModelConfig, checkpoint: CheckpointTensors, ctx: ParallelCtx, dtype: torch.dtype,
                   rank: int) -> RankFootprint:
    model = meta_decoder(cfg, ctx, dtype)
    shards = module_shards(model)
    plan = build_plan(cfg.spec, cfg, shards, {name: t.shape for name, t in checkpoint.planned.items()},
                      tied_copies={name for _, _, name, _ in tied_parameters(model)})
    missing = sorted(set(shards) - set(plan.expected))
    if missing:
        raise Refusal(f"parameter {missing[0]} is filled by no checkpoint tensor ({len(missing)} in all); "
                      "the weights lack tensors the config implies")
    seen: set[tuple] = set()
    extents: dict[str, list] = {}
    read = 0
    for r in plan.reads:
        tensor = checkpoint.planned[r.source]
        for piece in r.pieces:
            extent = _extent(piece, tensor.shape)
            key = (r.source, tuple(extent))
            if key in seen:  # one window serving interleaved parts is read once (the loader's rule)
                continue
            seen.add(key)
            read += math.prod(b - a for a, b in extent) * DTYPES[tensor.dtype].itemsize
            if r.source in checkpoint.scales:
                extents.setdefault(r.source, []).append(extent)
    scale_bytes = 0
    for weight, windows in extents.items():
        scale = checkpoint.tensors[checkpoint.scales[weight]]
        scale_bytes += _scale_blocks(windows, scale, checkpoint.block) * DTYPES[scale.dtype].itemsize
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return RankFootprint(rank, ctx.tp_rank, ctx.ep_rank, params, read + scale_bytes, scale_bytes,
                         PagedCache.block_bytes(model, 1, dtype))
