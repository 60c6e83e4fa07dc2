"""A kept FP8 matrix's product through the Triton block-scaled GEMM (`--kernels triton`,
kernels/triton/fp8.py): activations quantized per token and group of a block's width, the weight's
block scales ([128, 128] in DeepSeek's checkpoints) applied in the f32 sum, on any device Triton
runs on (where blockwise scaled_mm wants SM90). A share cut inside a block (a TP split off a block's
edge) is said once and left to parallel/linear.py's dense path."""

from __future__ import annotations

import torch

from ster_dist.kernels import select
from ster_dist.parallel.fp8 import Fp8Weight


def uniform_block(weight: Fp8Weight) -> tuple[int, int] | None:
    """The [rows, columns] of weight's scale blocks where every group but the last of each axis is
    that size (the share starts on a block), else None."""
    b0, b1 = weight.rows[0], weight.cols[0]
    if (
        all(g == b0 for g in weight.rows[:-1])
        and all(g == b1 for g in weight.cols[:-1])
        and weight.rows[-1] <= b0
        and weight.cols[-1] <= b1
    ):
        return b0, b1
    return None


def triton_product(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x W^T (+ b) in W's compute dtype through the Triton FP8 GEMM, or None where it does not take
    them."""
    if select.chosen() != "triton":  # the default path pays this one comparison
        return None
    from ster_dist.kernels.triton import usable
    from ster_dist.kernels.triton.fp8 import block_gemm, refuses_block

    if weight.q.dim() != 2 or not usable(x.device.type):
        return None
    block = uniform_block(weight)
    if block is None:
        select.fall_back(
            "FP8 GEMM", "an FP8 share cut inside a scale block (a TP split off a block's edge)"
        )
        return None
    if (reason := refuses_block(block)) is not None:
        select.fall_back("FP8 GEMM", reason)
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        select.fall_back(
            "FP8 GEMM", "a product that asks for gradients (the kernels have no backward)"
        )
        return None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = block_gemm(rows, weight.q, weight.scale.float(), weight.dtype, block).view(
        *x.shape[:-1], weight.q.shape[0]
    )
    return y if bias is None else y + bias.to(y.dtype)
