"""The Triton fused experts (kernels/triton/moe.py) under Triton's interpreter against a
token-by-token reference: tokens sorted by expert and padded to the block, runs longer than a block,
an expert no token chose, router weights applied; f32, bf16 and FP8 experts with [128, 128] block
scales."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # before the kernel modules are imported: their jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from ster_dist.kernels.triton.fp8 import FP8  # noqa: E402
from ster_dist.kernels.triton.moe import align_by_expert, fused_experts  # noqa: E402
from ster_dist.kernels.triton.reference import (
    dequantize_blocks,
    experts_reference,  # noqa: E402
    quantize_groups_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(tokens, topk, experts, seed):
    """Each token's distinct experts, never expert 2 (one expert with no tokens), expert 0 chosen by
    most (a run longer than a block of 16), and softmax router weights."""
    g = torch.Generator().manual_seed(seed)
    choices = [e for e in range(experts) if e != 2]
    ids = torch.stack(
        [
            torch.tensor(
                [0]
                + [
                    choices[1:][i]
                    for i in torch.randperm(len(choices) - 1, generator=g)[: topk - 1]
                ]
            )
            for _ in range(tokens)
        ]
    )
    weights = torch.softmax(torch.randn(tokens, topk, generator=g), -1)
    return ids, weights


def test_align_by_expert_pads_each_run_to_the_block():
    ids = torch.tensor([3, 0, 3, 3, 0])
    sorted_ids, block_expert = align_by_expert(ids, experts=4, block=2)
    runs = sorted_ids.view(-1, 2)[block_expert >= 0]
    assert block_expert[block_expert >= 0].tolist() == [0, 3, 3]
    assert runs.tolist() == [[1, 4], [0, 2], [3, 5]]  # 5: no pair (the padding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts(dtype):
    tokens, topk, experts, hidden, inner = 20, 2, 4, 48, 40  # sizes no tile divides
    ids, weights = _routing(tokens, topk, experts, 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=g) / 6).to(dtype)
    down = (torch.randn(experts, hidden, inner, generator=g) / 6).to(dtype)
    gate, up = gate_up.split(inner, 1)
    got = fused_experts(
        *(t.to(DEVICE).contiguous() for t in (x, ids, weights, gate, up, down))
    ).cpu()
    want = experts_reference(x, ids, weights, gate_up, down)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)


def test_fused_experts_fp8_blocks():
    tokens, topk, experts, hidden, inner = 10, 2, 3, 128, 128
    ids, weights = _routing(tokens, topk, experts, 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=g) / 4).to(FP8)
    down = (torch.randn(experts, hidden, inner, generator=g) / 4).to(FP8)
    gate_up_scale = torch.rand(experts, 2, 1, generator=g) / 8 + 0.01
    down_scale = torch.rand(experts, 1, 1, generator=g) / 8 + 0.01
    gate, up = (w.to(DEVICE).contiguous() for w in gate_up.split(inner, 1))
    scales = tuple(s.to(DEVICE).contiguous() for s in (*gate_up_scale.split(1, 1), down_scale))
    got = fused_experts(
        *(t.to(DEVICE) for t in (x, ids, weights)), gate, up, down.to(DEVICE), scales
    ).cpu()
    # the reference: activations through the same FP8 groups, weights dequantized block by block
    xq = dequantize_blocks(*quantize_groups_reference(x, 128), (1, 128))
    wide_gate_up = dequantize_blocks(gate_up, gate_up_scale, (128, 128))
    wide_down = dequantize_blocks(down, down_scale, (128, 128))
    want = experts_reference(xq, ids, weights, wide_gate_up, wide_down, fp8_inner=True)
    # the same FP8 values both ways; an f32 sum's last bit can tip one SwiGLU output to the next FP8
    # value
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().mean().item())


def test_fused_experts_refuses_fp8_without_scales():
    w = torch.zeros(2, 128, 128, dtype=FP8)
    with pytest.raises(ValueError, match="needs f32 scales"):
        fused_experts(
            torch.randn(1, 128), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), w, w, w
        )
