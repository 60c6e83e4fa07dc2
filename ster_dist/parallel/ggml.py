"""GGML block-quantized weights kept as a .gguf stores them (Q8_0, Q4_0, Q4_1): a rank's rows of
blocks, and the products and embedding lookups through them.

A kept matrix W [rows, cols] is held as its stored bytes, uint8 [rows, cols / 32 * block bytes]:
GGML quantizes each row in blocks of 32 along the input dimension, so a rank's output rows are whole
rows of bytes and its input columns (a row-parallel share) whole runs of blocks. The layouts, per
block of 32 values:

- Q8_0: f16 d, 32 int8 q; value = d * q
- Q4_0: f16 d, 16 bytes; low nibbles values 0-15, high nibbles 16-31; value = d * (q - 8)
- Q4_1: f16 d, f16 m, 16 bytes as Q4_0; value = d * q + m

The product: up to BLOCK_ROWS_MAX rows of x (decode) through kernels/blocks.cpp, which quantizes x
to 8 bits per block of 32 as llama.cpp does for its dot products and multiplies in integers (AVX-512
VNNI); more rows (prefill) through tiles of the weight dequantized to x's dtype, one tile at a time,
into the dense product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ster_dist import kernels

BLOCK = 32  # values per block in every kept kind
# kind -> (GGML type id, bytes per block of 32 values)
KINDS: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
# rows of x the block kernel takes; beyond, compute bounds the product: dequantized tiles
BLOCK_ROWS_MAX = 64
# weight elements dequantized at once for a product of many rows (4 MiB of f32)
TILE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class BlockWeight:
    """A kept matrix: its stored bytes, its kind (a key of KINDS), its columns and the dtype it
    computes in."""

    data: torch.Tensor
    kind: str
    cols: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_blocks(self.data, self.kind, self.cols).to(dtype or self.dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized (an embedding lookup): only the rows asked for are read."""
        rows = self.data.index_select(0, ids.reshape(-1))
        return (
            dequantize_blocks(rows, self.kind, self.cols).to(self.dtype).view(*ids.shape, self.cols)
        )


def block_bytes(kind: str, cols: int) -> int:
    """Bytes one row of `cols` values takes in `kind` (cols a multiple of BLOCK)."""
    return cols // BLOCK * KINDS[kind][1]


def dequantize_blocks(data: torch.Tensor, kind: str, cols: int) -> torch.Tensor:
    """float32 [rows, cols] from the bytes of `kind` blocks, uint8 [rows, cols / 32 * block
    bytes]."""
    rows = data.shape[0]
    blocks = data.reshape(rows, cols // BLOCK, KINDS[kind][1])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [rows, blocks, 1]
    if kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).view(rows, cols)
    packed = blocks[..., -16:]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()  # values 0-15, then 16-31
    if kind == "Q4_0":
        return ((q - 8.0) * d).view(rows, cols)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (q * d + m).view(rows, cols)


def block_product(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) over a kept matrix: the block kernel for few rows, dequantized tiles for many."""
    inner = x.shape[-1]
    rows = x.numel() // inner if inner else 0
    if (
        0 < rows <= BLOCK_ROWS_MAX
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and not x.requires_grad
        and kernels.ready()
    ):
        return torch.ops.ster_kernels.block_product(x, w.data, bias, KINDS[w.kind][0], w.cols)
    flat = x.reshape(rows, inner)
    step = max(1, TILE_ELEMENTS // max(1, w.cols))
    parts = [
        F.linear(
            flat,
            dequantize_blocks(w.data[i : i + step], w.kind, w.cols).to(x.dtype),
            None if bias is None else bias[i : i + step],
        )
        for i in range(0, w.data.shape[0], step)
    ]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y.view(*x.shape[:-1], w.data.shape[0])
