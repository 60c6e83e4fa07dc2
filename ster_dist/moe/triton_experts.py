"""A rank's experts through the Triton fused experts (`--kernels triton`, kernels/triton/moe.py):
the rows the MoE layer dispatched here, each with its one local expert (the router's weights are
applied by the layer), plain SwiGLU experts in the rows' dtype or kept in FP8 in whole scale blocks
([128, 128] in DeepSeek's). What the kernel does not take (another activation, biases, clamps, an
FP8 share cut inside a block by the TP split) is said once and runs the torch path
(moe/experts.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.kernels import select
from ster_dist.parallel.fp8 import Fp8Weight
from ster_dist.parallel.triton_fp8 import uniform_block


def triton_experts(experts, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor | None:
    """experts' output for rows x [rows, hidden] (local_ids [rows]) through the fused kernel, or
    None."""
    from ster_dist.kernels.triton import usable
    from ster_dist.kernels.triton.moe import fused_experts

    if not usable(x.device.type):
        return None
    if (
        experts.gate is None
        or experts.act is not F.silu
        or experts.gate_bias is not None
        or experts.clamped
        or experts.limited
        or experts.glu_limit
    ):
        select.fall_back(
            "experts", "experts other than plain SwiGLU (biases, clamps, another activation)"
        )
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        select.fall_back("experts", "a step that asks for gradients (the kernels have no backward)")
        return None
    gate, up, down = (experts.matrix(name) for name in ("gate", "up", "down"))
    ids = local_ids.reshape(-1, 1)
    # the layer applies the router's
    weights = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
    if isinstance(gate, Fp8Weight):
        blocks = {uniform_block(w) for w in (gate, up, down)}
        block = blocks.pop() if len(blocks) == 1 else None
        if block is None or block[1] & (block[1] - 1) or block[1] < 16:
            select.fall_back(
                "experts",
                "FP8 experts cut inside a scale block, or blocks not a power of two of at "
                "least 16 columns wide",
            )
            return None
        return fused_experts(
            x,
            ids,
            weights,
            gate.q,
            up.q,
            down.q,
            (gate.scale.float(), up.scale.float(), down.scale.float()),
            block,
        )
    if (
        gate.dtype != x.dtype
        or not all(w.stride(-1) == 1 for w in (gate, up, down))
        or up.stride() != gate.stride()
    ):
        select.fall_back("experts", f"{gate.dtype} experts under {x.dtype} rows or strided weights")
        return None
    return fused_experts(x, ids, weights, gate, up, down)
