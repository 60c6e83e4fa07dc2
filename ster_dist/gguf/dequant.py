"""Dequantizing a window of one GGUF tensor, reading only the bytes that window needs.

GGML quantizes each row in blocks along its last (input) dimension, so rows are
independent: a row window is a slice of the raw row bytes, and a column window
is the run of whole blocks that covers it. The arithmetic itself is the gguf
package's (gguf.quants.dequantize); this module only chooses the bytes and
bounds the float32 working memory.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

# Storage types read through gguf.quants.dequantize. The integer types (I8..I64)
# and F64 are not weights, and Q8_1/Q8_K are llama.cpp's intermediates; the
# package cannot dequantize them, so they are refused when the file is opened.
SUPPORTED: frozenset[Q] = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q8_0,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
        Q.IQ1_S,
        Q.IQ1_M,
        Q.IQ2_XXS,
        Q.IQ2_XS,
        Q.IQ2_S,
        Q.IQ3_XXS,
        Q.IQ3_S,
        Q.IQ4_NL,
        Q.IQ4_XS,
        Q.TQ1_0,
        Q.TQ2_0,
        Q.MXFP4,
    }
)

# Rows dequantized per step: bounds the float32 intermediate to about 64 MiB,
# whatever the window, before it is cast into the output at the asked precision.
_CHUNK_BYTES = 64 << 20


def row_bytes(qtype: Q, n_cols: int) -> int:
    """Bytes one row of n_cols values takes in this storage type."""
    block, size = GGML_QUANT_SIZES[qtype]
    if n_cols % block:
        raise ValueError(
            f"{n_cols} columns are not a whole number of {qtype.name} blocks of {block}"
        )
    return n_cols // block * size


def window_bytes(qtype: Q, rows: range, cols: range) -> int:
    """Raw bytes `dequantize_window` copies out of the file for this window."""
    if not len(rows) or not len(cols):
        return 0
    block, size = GGML_QUANT_SIZES[qtype]
    return len(rows) * (-(-cols.stop // block) - cols.start // block) * size


def dequantize_window(
    raw: np.ndarray, qtype: Q, rows: range, cols: range, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `rows` and columns `cols` (both step 1) of a tensor whose raw bytes are `raw`.

    `raw` is the tensor's bytes as a uint8 array [n_rows, row_bytes] (a memory map:
    slicing it reads nothing until the copy below). Returns [len(rows), len(cols)].
    """
    block, size = GGML_QUANT_SIZES[qtype]
    first, last = cols.start // block, -(-cols.stop // block)  # whole blocks covering cols
    skip = cols.start - first * block
    out = torch.empty((len(rows), len(cols)), dtype=dtype)
    if len(rows) == 0 or len(cols) == 0:
        return out
    step = max(1, _CHUNK_BYTES // (4 * (last - first) * block))
    for at in range(rows.start, rows.stop, step):
        stop = min(at + step, rows.stop)
        # Copy just these bytes out of the (read-only) map: dequantize needs
        # contiguous rows, and F32 comes back as a view of what it was given.
        chunk = np.array(raw[at:stop, first * size : last * size], copy=True)
        values = dequantize(chunk, qtype).reshape(stop - at, -1)[:, skip : skip + len(cols)]
        out[at - rows.start : stop - rows.start] = torch.from_numpy(np.ascontiguousarray(values))
    return out
