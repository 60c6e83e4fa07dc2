"""What one rank of a tp x ep run holds and reads, from a checkpoint's tensor names, dtypes and
shapes alone (its safetensors headers): no weight byte is read.

The rank's decoder is built on the meta device with that rank's ParallelCtx and the real shard plan
(shard/plan.py) is run over the headers' shapes, exactly as the loader runs it, so the figures are
the loader's, not a formula's: parameter bytes are what the rank allocates (at the compute dtype,
vocabulary padding included), read bytes are the windows its pieces read, in the files' dtypes.

Some checkpoint tensors are set aside or renamed before the plan sees them:
- multi-token-prediction layers (config `num_nextn_predict_layers`, a wrapper's text_config's too:
  where the family stores them, `model.layers.{N..}` past the decoder's layers or MiMo's
  `model.mtp_layers.{k}`), which
  plain decoding never reads; they are counted apart;
- FP8 scales (`X.weight_scale_inv` beside a float8 `X.weight` for quant_method fp8, `X.weight_scale`
  for compressed-tensors): a rank reads exactly the scale entries whose blocks cover its slices of
  X.weight (shard/fp8.py's scale_block says which block an entry covers); compressed-tensors'
  activation scales are never read;
- MXFP4 pairs (`X_blocks` and `X_scales`, quant_method mxfp4) are planned as the one tensor X the
  loader presents (shard/mxfp4.py): a rank reads the bytes and exponents of its experts, rows and
  32-value groups.

With `keep_fp8` (`--weights fp8`) the parameters the loader would keep (shard/fp8_kept.py, the same
rule over the same plan) count one byte an element plus their float32 scale groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ster_dist.config import ModelConfig
from ster_dist.config.quant import BlockFP8, CompressedFP8, Mxfp4
from ster_dist.errors import Refusal
from ster_dist.model.decoder import meta_decoder
from ster_dist.model.paged import PagedCache
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import module_shards, tied_parameters
from ster_dist.shard import mxfp4
from ster_dist.shard.fp8 import ACTIVATION_SCALES, scale_block
from ster_dist.shard.fp8_kept import kept_parameters, kept_scale_bytes
from ster_dist.shard.plan import Piece, build_plan, mtp_layer_pattern
from ster_dist.shard.safetensors_header import DTYPES


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor as its header states it."""

    # the safetensors tag (BF16, F8_E4M3, F32, ...) or a GGUF block type (Q4_1, Q8_0, F32, ...)
    dtype: str
    shape: tuple[int, ...]
    # a GGUF tensor's bytes as stored (blocks of values and their scales)
    stored_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        return (
            self.stored_bytes
            if self.stored_bytes is not None
            else self.bytes_of(math.prod(self.shape))
        )

    def bytes_of(self, elements: int) -> int:
        """Bytes a window of `elements` values reads: a GGUF tensor's at its blocks' bytes per value
        (exact for windows of whole blocks, as rows of a GGUF tensor are)."""
        if self.stored_bytes is None:
            return elements * DTYPES[self.dtype].itemsize
        return -(-elements * self.stored_bytes // max(1, math.prod(self.shape)))


@dataclass(frozen=True)
class CheckpointTensors:
    """A checkpoint's tensors sorted into what the plan reads, scales, set-aside tensors and MTP
    layers."""

    planned: dict[str, Tensor]
    scales: dict[str, str]  # an FP8 weight's name -> its scale tensor's name
    mtp: tuple[str, ...]  # multi-token-prediction tensors, never read by plain decoding
    block: tuple[int, int] | None  # FP8 weight_block_size (rows, columns) of quant_method fp8
    tensors: dict[str, Tensor]
    method: str | None = None  # the quantization: fp8, mxfp4, compressed-tensors
    # FP8 weight -> block one scale covers
    scale_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)
    # MXFP4: X -> (X_blocks, X_scales)
    packed: dict[str, tuple[str, str]] = field(default_factory=dict)
    unread: tuple[str, ...] = ()  # activation scales: stated by the checkpoint, never read


@dataclass(frozen=True)
class RankFootprint:
    rank: int
    tp_rank: int
    ep_rank: int
    # what the rank allocates for its parameters at the compute dtype (kept FP8 as FP8)
    parameter_bytes: int
    # what it reads from the files (weights and scales), in the files' dtypes
    read_bytes: int
    scale_bytes: int  # of which FP8 scales or MXFP4 exponents
    kv_bytes_per_token: int  # its paged KV cache per token, all layers, at the compute dtype
    # one sequence's recurrent state (Mamba, delta rule, ...), all layers
    state_bytes_per_sequence: int = 0
    pp_rank: int = 0
    layers: tuple[int, int] = (0, 0)  # [start, end) of the layers its pipeline stage holds


def sort_tensors(cfg: ModelConfig, tensors: dict[str, Tensor]) -> CheckpointTensors:
    """The tensors sorted by cfg.quant (config_quant.py has already refused a quantization that does
    not load)."""
    quant = cfg.quant
    # the config's count (a wrapper's text_config's), where the family stores them
    mtp_pattern = mtp_layer_pattern(cfg)
    planned, scales, blocks, mtp, unread = {}, {}, {}, [], []
    packed = (
        mxfp4.packed_pairs(
            {n: t.shape for n, t in tensors.items()}, {n: t.dtype for n, t in tensors.items()}
        )
        if isinstance(quant, Mxfp4)
        else {}
    )
    hidden = {n for pair in packed.values() for n in pair}
    suffix = quant.scale_suffix if isinstance(quant, (BlockFP8, CompressedFP8)) else None
    for name, tensor in tensors.items():
        if mtp_pattern is not None and mtp_pattern.match(name):
            mtp.append(name)
        elif name in hidden:
            continue
        elif (
            isinstance(quant, CompressedFP8)
            and quant.activations
            and name.endswith(ACTIVATION_SCALES)
        ):
            unread.append(name)
        elif suffix and name.endswith(suffix):
            weight = name[: -len(suffix)]
            if weight not in tensors or not tensors[weight].dtype.startswith("F8"):
                raise Refusal(
                    f"checkpoint tensor {name} scales no float8 tensor {weight}; "
                    f"the checkpoint is not FP8-quantized as its config ({quant.method}) says"
                )
            scales[weight] = name
            blocks[weight] = scale_block(quant, weight, tensors[weight].shape, tensor.shape)
        else:
            planned[name] = tensor
    for name, (blocks_name, _) in packed.items():
        planned[name] = Tensor("U8", mxfp4.presented_shape(tensors[blocks_name].shape))
    return CheckpointTensors(
        planned,
        scales,
        tuple(sorted(mtp)),
        quant.block if isinstance(quant, BlockFP8) else None,
        tensors,
        quant.method if quant else None,
        blocks,
        packed,
        tuple(sorted(unread)),
    )


def _extent(piece: Piece, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The source ranges one piece reads, one (start, stop) per dimension."""
    if piece.window is not None:
        window = tuple(piece.window) + (slice(None),) * (len(shape) - len(piece.window))
        return tuple(w.indices(n)[:2] for w, n in zip(window, shape))
    out = [(0, n) for n in shape]
    if piece.rows is not None and shape:
        out[0] = piece.rows.indices(shape[0])[:2]
    if piece.cols is not None and len(shape) >= 2:
        out[1] = piece.cols.indices(shape[1])[:2]
    return tuple(out)


def _packed_groups(name: str, extent: tuple[tuple[int, int], ...], inputs: int) -> int:
    """How many 32-value groups (each 16 bytes and one exponent) a window [experts, inputs, rows] of
    MXFP4 X reads."""
    (e0, e1), (q0, q1), (p0, p1) = extent
    g0, g1 = mxfp4.check_window(name, inputs, q0, q1) if q1 > q0 else (0, 0)
    return max(0, e1 - e0) * max(0, p1 - p0) * (g1 - g0)


def _scale_blocks(
    extents: list[tuple[tuple[int, int], ...]], scale: Tensor, block: tuple[int, int]
) -> int:
    """How many scale entries cover the given windows of the weight (its last two dims blocked)."""
    if len(scale.shape) < len(extents[0]):  # one scale for the tensor, stored as [] or [1]
        return 1

    def blocked(extent):
        (r0, r1), (c0, c1) = extent[-2:]
        return [
            *extent[:-2],
            (r0 // block[0], -(-r1 // block[0])),
            (c0 // block[1], -(-c1 // block[1])),
        ]

    spans = [blocked(e) for e in extents if all(b > a for a, b in e)]
    if len(spans) == 1:
        return math.prod(b - a for a, b in spans[0])
    grid = torch.zeros(scale.shape, dtype=torch.bool)  # pieces of one weight may share blocks
    for span in spans:
        grid[tuple(slice(a, b) for a, b in span)] = True
    return int(grid.sum())


def rank_footprint(
    cfg: ModelConfig,
    checkpoint: CheckpointTensors,
    ctx: ParallelCtx,
    dtype: torch.dtype,
    rank: int,
    keep_fp8: bool = False,
    matchers: dict | None = None,
) -> RankFootprint:
    model = meta_decoder(cfg, ctx, dtype)
    shards = module_shards(model)
    copies = tied_parameters(model)
    shapes = {name: t.shape for name, t in checkpoint.planned.items()}
    plan = build_plan(
        cfg.spec,
        cfg,
        shards,
        shapes,
        tied_copies={name for _, _, name, _ in copies},
        elsewhere=model.elsewhere,
        matchers=matchers,
    )
    missing = sorted(set(shards) - set(plan.expected))
    if missing:
        raise Refusal(
            f"parameter {missing[0]} is filled by no checkpoint tensor ({len(missing)} in all); "
            "the weights lack tensors the config implies"
        )
    # one window serving interleaved parts is read once (the loader's rule): the windows read so far
    # are kept for
    # the sources read by more than one piece, a few among 45,000 (kept for all, they weigh on the
    # collector)
    pieces_of: dict[str, int] = {}
    for r in plan.reads:
        pieces_of[r.source] = pieces_of.get(r.source, 0) + len(r.pieces)
    seen: set[tuple] = set()
    extents: dict[str, list] = {}
    # the plan hands many tensors one Piece (every layer's expert e reads the same window of its own
    # tensor):
    # a piece's extent over a shape is worked out once, keyed by the piece's identity (the plan
    # holds them all)
    extent_of: dict[tuple[int, tuple], tuple[tuple, int]] = {}
    read = packed_scales = 0
    for r in plan.reads:
        tensor = checkpoint.planned[r.source]
        for piece in r.pieces:
            memo = (id(piece), tensor.shape)
            if memo not in extent_of:
                extent = _extent(piece, tensor.shape)
                extent_of[memo] = extent, math.prod(b - a for a, b in extent)
            extent, area = extent_of[memo]
            if pieces_of[r.source] > 1:
                key = (r.source, extent)
                if key in seen:
                    continue
                seen.add(key)
            if r.source in checkpoint.packed:
                exponents = _packed_groups(r.source, extent, tensor.shape[1])
                read += exponents * mxfp4.GROUP_BYTES
                packed_scales += exponents
                continue
            read += tensor.bytes_of(area)
            if r.source in checkpoint.scales:
                extents.setdefault(r.source, []).append(extent)
    scale_bytes = packed_scales
    for weight, windows in extents.items():
        scale = checkpoint.tensors[checkpoint.scales[weight]]
        scale_bytes += (
            _scale_blocks(windows, scale, checkpoint.scale_blocks[weight])
            * DTYPES[scale.dtype].itemsize
        )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # the loader's own choice of kept parameters: one byte an element, plus their scale groups
    if keep_fp8:
        tied = {name for _, _, name, _ in copies} | {owner for _, _, _, owner in copies}
        kept = kept_parameters(model, plan, shapes, set(checkpoint.scales), tied)
        for name, spans in kept.items():
            shape = shards[name].local_shape()
            params += math.prod(shape) * (1 - dtype.itemsize) + kept_scale_bytes(
                spans, checkpoint.scale_blocks, shape
            )
    return RankFootprint(
        rank,
        ctx.tp_rank,
        ctx.ep_rank,
        params,
        read + scale_bytes,
        scale_bytes,
        PagedCache.block_bytes(model, 1, dtype),
        PagedCache.state_bytes(model),
        ctx.pp_rank,
        model.stage,
    )


# a config's torch_dtype, as the checkpoint's weights are most often stored; anything else counts as
# bf16
STORED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def estimated_footprint(
    cfg: ModelConfig, ctx: ParallelCtx, dtype: torch.dtype, rank: int
) -> RankFootprint:
    """What one rank holds, from the config alone (a directory with config.json and no weights): its
    meta-device decoder's parameters and KV cache are the loader's (the same shard plan of every
    layer), while what it would read is estimated as those parameters at the config's torch_dtype,
    there being no headers to say how the weights are stored (a quantized checkpoint stores
    less)."""
    model = meta_decoder(cfg, ctx, dtype)
    stored = STORED_DTYPES.get(str(cfg.torch_dtype), torch.bfloat16).itemsize
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    values = sum(p.numel() for p in model.parameters())
    return RankFootprint(
        rank,
        ctx.tp_rank,
        ctx.ep_rank,
        params,
        values * stored,
        0,
        PagedCache.block_bytes(model, 1, dtype),
        PagedCache.state_bytes(model),
        ctx.pp_rank,
        model.stage,
    )
