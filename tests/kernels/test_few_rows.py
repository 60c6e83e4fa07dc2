"""The few-row product kernel (kernels/few_rows.cpp), built here for this CPU: its products equal
F.linear's in f64 within the sums' rounding, dense() takes it for one to eight rows of f32 and bf16
and leaves it for more rows and for products that need gradients, and a process where it cannot be
built says so in one line and computes the same products through the library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ster_dist import kernels
from ster_dist.parallel.linear import dense
from tests.native_kernels import built

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernel():
    return built("few_rows", "dense keeps the library's products")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# whole SIMD steps, tails, shorter than one step
@pytest.mark.parametrize("inner", [576, 577, 40, 3, 1536])
def test_every_row_count_equals_the_f64_product(kernel, dtype, inner):
    gen = torch.Generator().manual_seed(inner)
    weight = torch.randn(131, inner, generator=gen).to(dtype)
    bias = torch.randn(131, generator=gen).to(dtype)
    for rows in range(1, kernels.FEW_ROWS_MAX + 1):
        x = torch.randn(rows, inner, generator=gen).to(dtype)
        want = F.linear(x.double(), weight.double(), bias.double())
        got = kernel(x, weight, bias)
        assert got.dtype == dtype and got.shape == (rows, 131)
        # f32: the sums' order alone; bf16: the product in f32, rounded once to bf16 (8 bits of
        # mantissa)
        assert _rel(got, want) < (1e-6 if dtype == torch.float32 else 4e-3), rows
        no_bias = kernel(x, weight, None)
        assert _rel(no_bias, F.linear(x.double(), weight.double())) < (
            1e-6 if dtype == torch.float32 else 4e-3
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_sum_whatever_rows_share_its_product(kernel, dtype):
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 577, generator=gen).to(dtype)
    x = torch.randn(kernels.FEW_ROWS_MAX, 577, generator=gen).to(dtype)
    alone = torch.cat([kernel(x[i : i + 1], weight, None) for i in range(len(x))])
    for rows in range(2, kernels.FEW_ROWS_MAX + 1):
        assert torch.equal(kernel(x[:rows], weight, None), alone[:rows])


def test_batched_and_strided_inputs_keep_their_shape(kernel):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 48, generator=gen)
    wide = torch.randn(3, 2, 96, generator=gen)
    x = wide[..., ::2]  # not contiguous: every other column
    got = kernel(x, weight, None)
    assert got.shape == (3, 2, 64)
    assert _rel(got, F.linear(x.double(), weight.double())) < 1e-6


def test_dense_takes_it_for_one_to_eight_rows_only(kernel):
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(96, 80, generator=gen).to(dtype)
        for rows in (1, 4, 7, 8):
            x = torch.randn(1, rows, 80, generator=gen).to(dtype)
            assert torch.equal(dense(x, weight), kernel(x, weight, None))
        many = torch.randn(1, 9, 80, generator=gen).to(dtype)
        assert _rel(dense(many, weight), F.linear(many.double(), weight.double())) < 5e-3
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        kernel(torch.randn(9, 80), torch.randn(96, 80), None)


def test_a_product_that_needs_gradients_keeps_the_library_kernel(kernel):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 16, generator=gen)
    x = torch.randn(2, 16, generator=gen, requires_grad=True)
    y = dense(x, weight)
    y.sum().backward()
    assert torch.allclose(x.grad, weight.sum(0).expand(2, 16))


def test_a_failed_build_says_so_once_and_products_stay_right(tmp_path):
    script = (
        "import torch, torch.nn.functional as F\n"
        "from ster_dist import kernels\n"
        "from ster_dist.parallel.linear import dense\n"
        "w, x = torch.randn(40, 24), torch.randn(3, 24)\n"
        "assert torch.allclose(dense(x, w), F.linear(x, w), atol=1e-5)\n"
        "assert torch.allclose(dense(x, w), F.linear(x, w), atol=1e-5)\n"
        "print(kernels.ready())\n"
    )
    env = {
        **os.environ,
        "CXX": "/bin/false",
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "builds"),
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    said = [line for line in done.stderr.splitlines() if "CPU kernels could not be built" in line]
    assert len(said) == 1, done.stderr

    env = {**os.environ, "STER_NATIVE_KERNELS": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False" and "kernels" not in done.stderr
