"""FP8 weights kept as stored (`--weights fp8`): a rank's float8_e4m3fn share of a matrix beside the
scale entries of the checkpoint blocks that cover it, and the product through them.

A kept matrix W [..., rows, cols] carries `scale` [..., row groups, col groups] and the sizes of
those groups: the rows (and columns) of the rank's share cut wherever a checkpoint block or a read
piece starts, so each group lies inside one block and one scale entry serves it. A share that starts
inside a block (a TP split at row 24 of blocks of 16) starts with a short group; the scale held is
exactly the entries covering the share.

The product: on a CUDA device whose torch has blockwise `scaled_mm` (SM90, 128 x 128 weight blocks
aligned with the share) the activations are quantized per 1 x 128 group and multiplied in FP8;
everywhere else the matrix is dequantized for the one product (in float32, then cast, the same
rounding as dequantizing while loading) and nothing is cached, so the dequantized copy lives for one
matmul only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# the one block size blockwise scaled_mm takes for weights (128 x 128) and activations (1 x 128)
BLOCKWISE = 128


@dataclass(frozen=True)
class Fp8Weight:
    """A kept FP8 matrix (or a stack of them, experts first), its scale groups and the dtype it
    computes in."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, expert: int) -> Fp8Weight:
        """One matrix of a stack (an expert)."""
        return Fp8Weight(self.q[expert], self.scale[expert], self.rows, self.cols, self.dtype)

    def expanded_scale(self) -> torch.Tensor:
        """One scale per element: each group's entry spread over its rows and columns."""
        device = self.scale.device
        rows = torch.tensor(self.rows, device=device)
        cols = torch.tensor(self.cols, device=device)
        return self.scale.repeat_interleave(
            rows, -2, output_size=self.q.shape[-2]
        ).repeat_interleave(cols, -1, output_size=self.q.shape[-1])

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if len(set(self.rows)) == 1 and len(set(self.cols)) == 1:
            # whole blocks only (the share starts on a block and divides into them): each entry
            # broadcast over
            # its block in place of a scale spread to every element, about 2.5x faster on a CPU
            (b0,), (b1,) = set(self.rows), set(self.cols)
            *lead, rows, cols = self.q.shape
            blocks = self.q.float().view(*lead, rows // b0, b0, cols // b1, b1)
            return (blocks * self.scale[..., :, None, :, None]).view(self.q.shape).to(dtype)
        return (self.q.float() * self.expanded_scale()).to(dtype)


def blockwise_ok(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether this product can run through blockwise scaled_mm: SM90, 128 x 128 groups from the
    first row and column (a share split inside a block is not), and shapes its kernel takes."""
    if x.device.type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or w.q.dim() != 2:
        return False
    # torch restricts the FP32-scale recipes to SM90
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    out_features, inner = w.q.shape
    whole = all(n == BLOCKWISE for n in w.rows[:-1]) and all(n == BLOCKWISE for n in w.cols)
    return whole and inner % BLOCKWISE == 0 and out_features % 16 == 0


def scaled_product(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) in FP8 on the tensor cores: x quantized per token and 128 columns (DeepSeek's
    recipe)."""
    inner = x.shape[-1]
    rows = x.reshape(-1, inner)
    m = rows.shape[0]
    pad = -m % 4  # the kernel wants whole groups of 4 rows
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
    groups = rows.float().view(rows.shape[0], inner // BLOCKWISE, BLOCKWISE)
    x_scale = groups.abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
    x_q = (groups / x_scale.unsqueeze(-1)).view(rows.shape).to(FP8)
    scale_b = w.scale
    # the weight scales' column count padded to a multiple of 4, as the kernel reads
    if scale_b.shape[1] % 4:
        scale_b = F.pad(scale_b, (0, -scale_b.shape[1] % 4))
    y = F.scaled_mm(
        x_q,
        w.q.t(),
        x_scale.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        scale_b.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )[:m]
    y = y.reshape(*x.shape[:-1], w.q.shape[0])
    return y if bias is None else y + bias
