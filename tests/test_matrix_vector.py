"""ster_dist's matrix-vector kernel (ster_dist/kernels): the decode products of 1 to 4 rows.

It is checked against torch's own product on shapes that leave every remainder (inputs not a multiple of the
8-wide vector, outputs not a multiple of the rows taken at once), in f32 and bf16, at one and two threads,
inside a compiled graph, and through `dense`, where it must not take a product that needs gradients.
"""

import pytest
import torch
import torch.nn.functional as F

from ster_dist import kernels
from ster_dist.parallel.linear import dense

pytestmark = pytest.mark.skipif(kernels.prepare() is not None, reason=f"kernel not used here: {kernels.status()}")


def product(x, w):
    return torch.ops.ster_kernels.matrix_vector(x, w)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("inputs, outputs", [(37, 13), (576, 960), (8, 1), (1536, 577)])
def test_f32_equals_torch(rows, inputs, outputs, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows * 1000 + inputs + outputs)
        x, w = torch.randn(rows, inputs, generator=gen), torch.randn(outputs, inputs, generator=gen)
        got, want = product(x, w), (x.double() @ w.double().t())
        assert got.dtype == torch.float32 and got.shape == (rows, outputs)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * inputs ** 0.5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 3])
def test_bf16_weights_sum_in_f32(rows):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 200, generator=gen).bfloat16(), torch.randn(70, 200, generator=gen).bfloat16()
    got = product(x, w)
    assert got.dtype == torch.bfloat16
    # the exact sum of the bf16 numbers, rounded once to bf16: what torch's own bf16 product gives
    want = (x.double() @ w.double().t()).bfloat16()
    assert torch.equal(got, want) or (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7
    assert torch.allclose(got.float(), F.linear(x, w).float(), rtol=2 ** -7, atol=1e-2)


def test_refuses_what_it_does_not_take():
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        product(torch.randn(5, 8), torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="f32 or bf16"):
        product(torch.randn(1, 8).half(), torch.randn(3, 8).half())
    with pytest.raises(RuntimeError, match="contiguous"):
        product(torch.randn(1, 8), torch.randn(8, 3).t())


def test_inside_a_compiled_graph():
    x, w = torch.randn(2, 40), torch.randn(24, 40)
    traced = torch.compile(lambda x, w: torch.relu(product(x * 2, w)), fullgraph=True)
    assert torch.allclose(traced(x, w), torch.relu((2 * x) @ w.t()), rtol=1e-5, atol=1e-5)


def test_dense_takes_decode_rows_and_leaves_gradients_to_torch():
    w, bias = torch.randn(30, 16), torch.randn(30)
    x = torch.randn(1, 1, 16)
    with torch.inference_mode():
        assert torch.allclose(dense(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    trained = torch.randn(2, 16, requires_grad=True)
    dense(trained, w).sum().backward()  # the kernel has no backward: dense must not route this through it
    assert torch.allclose(trained.grad, w.sum(0).expand(2, 16))
