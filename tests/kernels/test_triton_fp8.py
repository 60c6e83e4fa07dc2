"""The Triton FP8 kernels (kernels/triton/fp8.py) under Triton's interpreter: the per-token-group
quantizer gives torch's FP8 bits (round to nearest even, values that cross a binade when rounded
included), and the block-scaled product equals the product of the dequantized operands."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # before the kernel modules are imported: their jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from ster_dist.kernels.triton.fp8 import FP8, block_gemm, quantize_groups  # noqa: E402
from ster_dist.kernels.triton.reference import dequantize_blocks, quantize_groups_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_quantize_groups_gives_torchs_bits():
    g = torch.Generator().manual_seed(0)
    # 3 groups, the last short; many binades
    x = torch.randn(5, 300, generator=g) * torch.logspace(-3, 3, 300)
    x[0, :8] = torch.tensor([448.0, -448.0, 0.0, 30.9, 31.5, 1e-3, -(2.0**-8), 2.0**-10])
    q, s = quantize_groups(x.to(DEVICE), 128)
    want_q, want_s = quantize_groups_reference(x, 128)
    torch.testing.assert_close(s.cpu(), want_s, rtol=0, atol=0)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_gemm_equals_the_dequantized_product(dtype):
    g = torch.Generator().manual_seed(1)
    m, n, k = 5, 192, 256  # a partial block of rows and of outputs (192 = 128 + 64)
    x = torch.randn(m, k, generator=g).to(dtype)
    weight = (torch.randn(n, k, generator=g) * 0.5).to(FP8)
    scale = torch.rand(2, 2, generator=g) + 0.5
    got = block_gemm(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), dtype).cpu()
    xq, xs = quantize_groups_reference(x, 128)
    want = dequantize_blocks(xq, xs, (1, 128)) @ dequantize_blocks(weight, scale, (128, 128)).T
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.float(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4
    )


def test_block_gemm_refuses_scales_of_other_blocks():
    with pytest.raises(ValueError, match="do not fit blocks"):
        block_gemm(
            torch.randn(2, 256), torch.zeros(128, 256, dtype=FP8), torch.ones(1, 1), torch.float32
        )
    with pytest.raises(ValueError, match="weight: dtype"):
        block_gemm(torch.randn(2, 256), torch.zeros(128, 256), torch.ones(1, 2), torch.float32)
