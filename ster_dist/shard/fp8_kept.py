"""Which parameters `--weights fp8` keeps in FP8, and the scale groups each one holds: one rule,
read by the loader (which fills them) and by `ster plan` (which counts their bytes).

A parameter is kept when its module can compute through FP8 (ShardedModule.fp8_params: the column-
and row-parallel projections and the stacked experts), it is nobody's tied copy, and every piece the
shard plan fills it from is a plain window of an FP8 checkpoint tensor (no transposed or interleaved
source). Anything else (norms, embeddings, routers, heads, which the published checkpoints store in
BF16 anyway) loads dequantized to --precision as in the default mode.

A kept parameter's rows are cut into groups wherever one of its pieces starts or ends and wherever a
checkpoint block starts inside a piece; columns alike. Each group then lies inside one block of one
source tensor, so one scale entry serves it. A share read as one window (a TP rank's rows, an
expert's matrix) gets exactly the entries of the blocks covering it, as it read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ster_dist.parallel.linear import ShardedModule
from ster_dist.shard.plan import Piece, Plan


@dataclass(frozen=True)
class Span:
    """Where one piece of a kept parameter comes from and lands: the source window (one slice per
    source dimension), and the parameter's leading index (experts) and local rows and columns it
    fills."""

    window: tuple[slice, ...]
    lead: tuple[int | slice, ...]
    rows: tuple[int, int]
    cols: tuple[int, int]
    src_rows: tuple[int, int]
    src_cols: tuple[int, int]


def span_of(
    piece: Piece, source_shape: tuple[int, ...], local_shape: tuple[int, ...]
) -> Span | None:
    """The span of a piece, or None where the piece is not a plain window of a matrix (kept FP8
    takes none)."""
    if piece.transpose or piece.take is not None or len(source_shape) < 2 or len(local_shape) < 2:
        return None
    if piece.window is not None:
        window = tuple(piece.window) + (slice(None),) * (len(source_shape) - len(piece.window))
    else:
        window = (
            piece.rows or slice(None),
            piece.cols or slice(None),
            *(slice(None),) * (len(source_shape) - 2),
        )
    window = tuple(slice(*w.indices(n)[:2]) for w, n in zip(window, source_shape, strict=True))
    dst = tuple(piece.dst) + (slice(None),) * (len(local_shape) - len(piece.dst))
    rows, cols = (
        d.indices(n)[:2] if isinstance(d, slice) else None
        for d, n in zip(dst[-2:], local_shape[-2:])
    )
    src_rows, src_cols = ((w.start, w.stop) for w in window[-2:])
    if (
        rows is None
        or cols is None
        or rows[1] - rows[0] != src_rows[1] - src_rows[0]
        or cols[1] - cols[0] != src_cols[1] - src_cols[0]
    ):
        return None
    return Span(window, dst[:-2], rows, cols, src_rows, src_cols)


def kept_parameters(
    model: nn.Module,
    plan: Plan,
    shapes: dict[str, tuple[int, ...]],
    quantized: set[str],
    tied: set[str],
) -> dict[str, list[tuple[str, Span]]]:
    """Kept parameter name -> its (source tensor, span) pieces, by the module docstring's rule."""
    owners = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ShardedModule):
            for attr in module.fp8_params:
                if attr in module.shards and module.shards[attr].pad_to is None:
                    owners[f"{prefix}.{attr}" if prefix else attr] = module.shards[
                        attr
                    ].local_shape()
    pieces: dict[str, list[tuple[str, Span]]] = {}
    refused: set[str] = set(tied)
    for read in plan.reads:
        if read.param not in owners or read.source not in quantized:
            refused.add(read.param)
            continue
        for piece in read.pieces:
            span = span_of(piece, shapes[read.source], owners[read.param])
            if span is None:
                refused.add(read.param)
                break
            pieces.setdefault(read.param, []).append((read.source, span))
    return {name: spans for name, spans in pieces.items() if name not in refused}


def groups(
    spans: list[tuple[str, Span]], blocks: dict[str, tuple[int, int]], local_shape: tuple[int, ...]
) -> tuple[list[int], list[int]]:
    """The boundaries of a kept parameter's row groups and column groups, [0, ..., rows] and [0,
    ..., cols]."""
    row_cuts, col_cuts = {0, local_shape[-2]}, {0, local_shape[-1]}
    for source, span in spans:
        b0, b1 = blocks[source]
        for cuts, (d0, d1), (s0, s1), b in (
            (row_cuts, span.rows, span.src_rows, b0),
            (col_cuts, span.cols, span.src_cols, b1),
        ):
            cuts.update((d0, d1))
            cuts.update(d0 + k * b - s0 for k in range(s0 // b + 1, -(-s1 // b)))
    return sorted(row_cuts), sorted(col_cuts)


def kept_scale_bytes(
    spans: list[tuple[str, Span]], blocks: dict[str, tuple[int, int]], local_shape: tuple[int, ...]
) -> int:
    """Bytes of the float32 scales a kept parameter holds: one entry per group, per leading
    index."""
    rows, cols = groups(spans, blocks, local_shape)
    return math.prod(local_shape[:-2]) * (len(rows) - 1) * (len(cols) - 1) * 4


class ScaleGrid:
    """A kept parameter's scales, filled piece by piece as the loader reads them."""

    def __init__(
        self,
        spans: list[tuple[str, Span]],
        blocks: dict[str, tuple[int, int]],
        local_shape: tuple[int, ...],
        device: torch.device | str,
    ):
        self.row_cuts, self.col_cuts = groups(spans, blocks, local_shape)
        self.scale = torch.full(
            (*local_shape[:-2], len(self.row_cuts) - 1, len(self.col_cuts) - 1),
            float("nan"),
            device=device,
        )

    def put(self, span: Span, block: tuple[int, int], entries: torch.Tensor) -> None:
        """`entries` [..., blocks covering the span's rows, ... its columns]: the source scale
        window."""
        rows = self._select(self.row_cuts, span.rows, span.src_rows, block[0])
        cols = self._select(self.col_cuts, span.cols, span.src_cols, block[1])
        g0, g1 = self.row_cuts.index(span.rows[0]), self.row_cuts.index(span.rows[1])
        h0, h1 = self.col_cuts.index(span.cols[0]), self.col_cuts.index(span.cols[1])
        picked = entries.float()[..., rows, :][..., cols]
        self.scale[(*span.lead, slice(g0, g1), slice(h0, h1))] = picked.to(self.scale.device)

    @staticmethod
    def _select(
        cuts: list[int], local: tuple[int, int], source: tuple[int, int], block: int
    ) -> list[int]:
        """For each group inside `local`, the index of its block within the source window's covering
        blocks."""
        first = source[0] // block
        inside = [c for c in cuts if local[0] <= c < local[1]]
        return [(source[0] + c - local[0]) // block - first for c in inside]

    def sizes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (
            tuple(b - a for a, b in zip(self.row_cuts, self.row_cuts[1:])),
            tuple(b - a for a, b in zip(self.col_cuts, self.col_cuts[1:])),
        )
