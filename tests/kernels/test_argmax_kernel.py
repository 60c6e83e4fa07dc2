"""kernels.argmax (kernels/argmax.cpp) against torch.argmax(x, -1), the index greedy steps and the
sampler pick a token by: the first largest element of each row, or its first NaN; f32 and bf16; rows
of any width, ties, infinities, non-contiguous and batched inputs."""

from __future__ import annotations

import pytest
import torch

from ster_dist import kernels
from ster_dist.engine.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.skipif(
    not kernels.ready(), reason="ster_dist's CPU kernels cannot be built here"
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 1), (1, 15), (1, 16), (3, 17), (33, 49152), (2, 5, 1000), (7,)]
)
def test_random_rows_pick_what_torch_picks(dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    got = torch.ops.ster_kernels.argmax_rows(x)
    assert got.dtype == torch.long and got.shape == shape[:-1]
    assert torch.equal(got, x.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_nans_and_infinities_pick_what_torch_picks(dtype):
    n = 37  # two whole registers and a tail
    rows = torch.randn(10, n).to(dtype)
    rows[0] = 1.0  # every element the maximum: the first
    rows[1, [5, 20, 36]] = 100.0  # tied maxima across registers and the tail
    rows[2, [30, 3]] = float("nan")  # NaN wins, the first one
    rows[3, 36] = float("nan")  # a NaN in the tail only
    rows[4] = float("-inf")  # nothing above -inf: index 0
    rows[5, 17] = float("inf")
    rows[6] = 0.0
    rows[6, 9] = -0.0  # -0.0 == 0.0: the first of them
    rows[7, :] = -1e30
    rows[7, 36] = -1e29  # the maximum in the tail's last lane
    rows[8, 0] = float("nan")
    rows[9, 1:] = float("-inf")
    want = rows.argmax(-1)
    assert torch.equal(torch.ops.ster_kernels.argmax_rows(rows), want)
    assert want[:4].tolist() == [0, 5, 3, 36]  # the cases above are what the test says they are


def test_a_strided_view_and_a_refused_input():
    x = torch.randn(6, 300)
    view = x[::2, 7:250]  # rows apart in memory, not starting at their first element
    assert not view.is_contiguous()
    assert torch.equal(kernels.argmax(view), view.argmax(-1))
    with pytest.raises(RuntimeError, match="f32 or bf16"):
        torch.ops.ster_kernels.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="at least one element a row"):
        torch.ops.ster_kernels.argmax_rows(torch.zeros(2, 0))
    # what the kernel does not take goes to torch: the same answer
    half = torch.randn(4, 50).half()
    assert torch.equal(kernels.argmax(half), half.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sampler_picks_greedy_tokens_through_it(dtype):
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(4)).to(dtype)
    logits[2, [10, 2000]] = 50.0  # a tie: the lower id, as torch picks
    sampler = Sampler()
    ids = [f"s{i}" for i in range(5)]
    for i in ids:
        sampler.add(i, SamplingParams(temperature=0.0), prompt_ids=[1, 2])
    tokens, _ = sampler.sample(logits, ids)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert tokens[2].item() == 10
