"""Weights packed ahead (parallel/packed.py): products over a packed weight equal the plain
weight's, a row's product over panels is the same bits in any batch, a weight changed in place or
freed is never read packed, and an engine packs where asked, says so, answers as one that does not,
and releases the copies when it closes."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from ster_dist import kernels
from ster_dist.engine import runner
from ster_dist.engine.sampling import SamplingParams
from ster_dist.parallel import packed
from ster_dist.parallel.linear import NATIVE_HALF_PRODUCTS, dense
from tests.engine.test_engine import llama, open_engine, prompts  # noqa: F401  (llama: the tiny checkpoint fixture)

pytestmark = pytest.mark.skipif(
    not packed.available(), reason="neither panels nor oneDNN to pack weights for here"
)

# bf16 in panels, for oneDNN, or as an f32 copy (packed.widened)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 9, 33, 130])
def test_a_product_over_the_packed_weight_equals_the_plain_one(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(200, 96, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
    x = torch.randn(2, rows, 96, generator=g).to(dtype)
    plain = dense(x, w, bias)
    assert (
        packed.pack(w)
        == packed.copy_bytes(w)
        >= w.numel() * (4 if packed.widened(dtype) else w.element_size())
    )
    try:
        held = packed.lookup(w)
        assert packed.active() and held is not None and held.panels == kernels.panels(dtype)
        assert held.widened == packed.widened(dtype) and held.widened == (
            dtype == torch.bfloat16 and not NATIVE_HALF_PRODUCTS and not kernels.panels(dtype)
        )
        got = dense(x, w, bias)
        want = (x.double() @ w.double().t() + bias.double()).to(dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * 10)
        if dtype == torch.float32 and rows * 2 > 8 and not held.panels:
            # oneDNN either way: its packed layout changes no sum's order
            assert torch.equal(got, plain)
    finally:
        packed.release([w])
    assert not packed.active()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(200, 96), (37, 33), (64, 1), (5, 130)])
def test_a_row_over_panels_is_the_same_bits_alone_or_in_any_batch(shape, dtype):
    if not kernels.panels(dtype):
        pytest.skip(f"this CPU's kernels lay out no {dtype} panels (AVX-512, AVX512_BF16 for bf16)")
    g = torch.Generator().manual_seed(shape[1])
    out, inner = shape  # outputs not a multiple of the panel's 32, inputs odd (a bf16 pair padded)
    w, bias = (
        torch.randn(out, inner, generator=g).to(dtype),
        torch.randn(out, generator=g).to(dtype),
    )
    x = torch.randn(29, inner, generator=g).to(dtype)  # two blocks of 12 rows and a rest
    packed.pack(w)
    try:
        batch = dense(x, w, bias)
        want = (x.double() @ w.double().t() + bias.double()).to(dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(batch, want, rtol=tolerance, atol=tolerance * 10)
        for rows in (slice(0, 1), slice(3, 5), slice(7, 20), slice(28, 29)):
            assert torch.equal(dense(x[rows], w, bias), batch[rows])
        torch.testing.assert_close(
            dense(x, w),
            (x.double() @ w.double().t()).to(dtype),
            rtol=tolerance,
            atol=tolerance * 10,
        )
    finally:
        packed.release([w])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 16])
def test_products_read_the_packed_copy_and_an_in_place_change_drops_it(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=g).to(dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-1}
    try:
        before = (x.double() @ weight.double().t()).to(dtype)
        packed.pack(weight)
        # a write through .data is one the version counter cannot see: where the product takes the
        # packed copy
        # (panels at any row count, oneDNN's from ROWS_MIN rows), it still reads the old weight
        weight.data.mul_(2)
        reads_copy = kernels.panels(dtype) or rows >= packed.ROWS_MIN
        torch.testing.assert_close(
            dense(x, weight), before if reads_copy else 2 * before, **tolerance
        )
        # a tracked in-place change (as an optimizer step makes) leaves the copy stale: dropped, the
        # weight read
        # plain, through the same kernels as a weight never packed
        with torch.no_grad():
            weight.add_(1)
        torch.testing.assert_close(
            dense(x, weight), (x.double() @ weight.double().t()).to(dtype), **tolerance
        )
        assert packed.lookup(weight) is None and not packed.active()
    finally:
        packed.release([weight])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_flow_through_a_packed_weight_as_through_the_plain_one(dtype):
    g = torch.Generator().manual_seed(3)
    weight, bias = (
        torch.randn(200, 96, generator=g).to(dtype),
        torch.randn(200, generator=g).to(dtype),
    )
    x = torch.randn(24, 96, generator=g).to(dtype)
    plain = x.clone().requires_grad_()
    F.linear(plain.float(), weight.float(), bias.float()).square().sum().backward()
    packed.pack(weight)
    try:
        tracked = x.clone().requires_grad_()
        dense(tracked, weight, bias).float().square().sum().backward()
    finally:
        packed.release([weight])
    # bf16: the output and the gradient each rounded to 8 bits
    scale = plain.grad.float().abs().max().item()
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2 * scale}
    torch.testing.assert_close(tracked.grad.float(), plain.grad.float(), **tolerance)


def test_a_freed_weight_takes_its_packed_copy_with_it():
    # the C++ table that compiled graphs read holds every packed copy (panels or oneDNN's)
    native = kernels.ready()
    held = torch.ops.ster_kernels.held_count() if native else 0
    w = torch.randn(64, 32)
    packed.pack(w)
    assert packed.active()
    if native:
        assert torch.ops.ster_kernels.held_count() == held + 1
    del w
    gc.collect()
    assert not packed.active()
    if native:
        assert torch.ops.ster_kernels.held_count() == held


def test_a_packed_engine_answers_as_an_unpacked_one_and_releases_its_copies(llama, capfd):  # noqa: F811
    batch = [
        (p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts(9, seed=5, lo=2, hi=40)
    ]
    with open_engine(llama, pack_weights="off") as engine:
        assert not packed.active()
        want = [s.result().token_ids for s in [engine.submit(p, params) for p, params in batch]]
    with open_engine(llama, pack_weights="on") as engine:
        assert packed.active()
        got = [s.result().token_ids for s in [engine.submit(p, params) for p, params in batch]]
    assert not packed.active()  # closed: the copies went with the engine
    assert got == want
    said = capfd.readouterr().err
    assert (
        "KiB of weights per rank for the CPU's products (--pack-weights off keeps one copy)" in said
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_on_packs_either_dtype_on_any_cpu_and_its_logits_are_the_unpacked_ones(llama, dtype):  # noqa: F811
    """--pack-weights on in either dtype on any CPU packs the weights (in panels, for oneDNN, or,
    bf16 where oneDNN refuses to reorder it, on AVX2, as an f32 copy) and the engine's logits are
    the unpacked engine's."""
    name = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    ids = tuple(range(0, 300, 7))
    params = SamplingParams(max_tokens=3, ignore_eos=True, logits_of=ids)
    batch = prompts(5, seed=9, lo=2, hi=30)
    with open_engine(llama, dtype=name, pack_weights="off") as engine:
        want = [s.result().scores for s in [engine.submit(p, params) for p in batch]]
    with open_engine(llama, dtype=name, pack_weights="on") as engine:
        assert packed.active()  # in panels, for oneDNN, or (bf16 on AVX2) as an f32 copy
        assert all(held.packed.widened == packed.widened(dtype) for held in packed._TABLE.values())
        got = [s.result().scores for s in [engine.submit(p, params) for p in batch]]
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for g, w in zip(got, want):  # the first sampled position: both read the same prompt
        torch.testing.assert_close(
            torch.tensor(g[0]), torch.tensor(w[0]), rtol=tolerance, atol=tolerance
        )


def test_auto_packs_only_where_the_copies_fit_in_their_share_of_free_memory(llama, monkeypatch):  # noqa: F811
    with open_engine(llama, pack_weights="auto"):
        assert packed.active()  # a tiny model's copies fit anywhere
    monkeypatch.setattr(runner, "PACK_SHARE", 1 << 60)  # a share of free memory no weight fits in
    with open_engine(llama, pack_weights="auto"):
        assert not packed.active()
    with open_engine(llama, pack_weights="on"):
        assert packed.active()  # on: whatever memory says


def test_over_panels_a_request_reads_the_same_logprobs_alone_or_in_a_batch(llama):  # noqa: F811
    """Products over panels, the paged attention kernels and the engine's row-wise steps are each
    the same sums for a row whatever shares its step: a request's logprobs are the same bits alone
    or among others."""
    if not kernels.panels(torch.float32):
        pytest.skip("this CPU's kernels lay out no panels (AVX-512)")
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    first, *others = prompts(9, seed=11, lo=3, hi=40)
    with open_engine(llama, pack_weights="on", prefix_caching=False) as engine:
        assert packed.active() and all(held.packed.panels for held in packed._TABLE.values())
        alone = engine.submit(first, params).result()
        streams = [engine.submit(p, params) for p in [*others[:4], first, *others[4:]]]
        batched = [s.result() for s in streams][4]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == alone.logprobs
