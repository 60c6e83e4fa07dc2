"""Which parameters a .gguf's Q8_0/Q4_0/Q4_1 tensors fill as stored (parallel/ggml.py), and filling
them.

A parameter is kept in blocks when its module names it in `ggml_params` (column- and row-parallel
projections, the embedding, the head), every piece the shard plan fills it from is a plain window
(no transposed, interleaved or stacked source) of a tensor the source stores in one kept kind, all
of the same kind, and it is nobody's tied copy. Its rows are then the stored rows of bytes (q/k rows
unpermuted as the source reads them) and its columns whole runs of blocks: a rank's column share
that starts or ends inside a block (a row-parallel split of 96 columns over 2 ranks of Q4 blocks of
32 would not, one of 80 would) is refused before anything is read, naming the block size. Everything
else (norms, F32/F16 tensors, kinds without a kernel) loads dequantized.
"""

from __future__ import annotations

import torch
from torch import nn

from ster_dist.errors import Refusal
from ster_dist.parallel.ggml import BLOCK, block_bytes
from ster_dist.parallel.linear import ShardedModule
from ster_dist.shard.fp8_kept import Span, span_of
from ster_dist.shard.plan import Plan


def kept_blocks(
    model: nn.Module, plan: Plan, shapes: dict[str, tuple[int, ...]], source, tied: set[str]
) -> dict[str, tuple[str, list[tuple[str, Span]]]]:
    """Kept parameter name -> (its kind, its (source tensor, span) pieces), by the module
    docstring's rule."""
    owners = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ShardedModule):
            for attr in module.ggml_params:
                if attr in module.shards:
                    owners[f"{prefix}.{attr}" if prefix else attr] = module.shards[
                        attr
                    ].local_shape()
    found: dict[str, tuple[str, list[tuple[str, Span]]]] = {}
    refused: set[str] = set(tied)
    for read in plan.reads:
        kind = source.kept_kind(read.source) if read.param in owners and not read.stacked else None
        if kind is None or found.get(read.param, (kind,))[0] != kind:
            refused.add(read.param)
            continue
        for piece in read.pieces:
            span = span_of(piece, shapes[read.source], owners[read.param])
            if span is None or len(shapes[read.source]) != 2 or piece.window is not None:
                refused.add(read.param)
                break
            found.setdefault(read.param, (kind, []))[1].append((read.source, span))
    kept = {name: spans for name, spans in found.items() if name not in refused}
    for name, (kind, spans) in kept.items():
        for source_name, span in spans:
            (start, stop), width = span.src_cols, shapes[source_name][1]
            if start % BLOCK or (stop % BLOCK and stop != width) or span.cols[0] % BLOCK:
                raise Refusal(
                    f"{name} takes columns {start}-{stop} of {source_name}, which cut its {kind} "
                    f"blocks of {BLOCK}; use a --tp that splits {width} columns into multiples of "
                    f"{BLOCK}, or import the .gguf with --safetensors (dequantized)"
                )
    return kept


def allocate_kept(model: nn.Module, kept: dict, local_shapes: dict[str, tuple[int, ...]]) -> None:
    """Kept parameters replaced, still on the meta device, by uint8 ones of their stored bytes'
    shape."""
    modules = dict(model.named_modules())
    for name, (kind, _) in kept.items():
        prefix, _, attr = name.rpartition(".")
        rows, cols = local_shapes[name]
        modules[prefix]._parameters[attr] = nn.Parameter(
            torch.empty(
                (rows, block_bytes(kind, -(-cols // BLOCK) * BLOCK)),
                dtype=torch.uint8,
                device="meta",
            ),
            requires_grad=False,
        )


def fill_kept(source, target: torch.Tensor, kind: str, spans: list[tuple[str, Span]]) -> None:
    """Each piece's stored bytes into the kept parameter's rows and block columns."""
    per_block = block_bytes(kind, BLOCK)
    for name, span in spans:
        data = source.read_blocks(name, slice(*span.src_rows), slice(*span.src_cols))
        first = span.cols[0] // BLOCK * per_block
        target[span.rows[0] : span.rows[1], first : first + data.shape[1]] = data


def mark_kept(
    model: nn.Module, kept: dict, local_shapes: dict[str, tuple[int, ...]], dtype: torch.dtype
) -> None:
    modules = dict(model.named_modules())
    for name, (kind, _) in kept.items():
        prefix, _, attr = name.rpartition(".")
        modules[prefix].keep_blocks(attr, kind, local_shapes[name][1], dtype)
