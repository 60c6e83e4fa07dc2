"""The Triton attention kernels (ster_dist/kernels/triton) against their torch references, run on
the CPU under Triton's interpreter: shapes that cross the cache's blocks and the decode's splits
(ragged sequences, a window shorter than the context that starts mid-block, GQA), with soft caps,
sinks and per-layer scales."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # before the kernel modules are imported: their jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from ster_dist.kernels.triton.decode import paged_decode  # noqa: E402
from ster_dist.kernels.triton.extend import paged_extend  # noqa: E402
from ster_dist.kernels.triton.mla import mla_decode  # noqa: E402
from ster_dist.kernels.triton.reference import (
    mla_decode_reference,
    paged_decode_reference,  # noqa: E402
    paged_extend_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(blocks, page, kv_heads, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks, page, kv_heads, d, generator=g).to(dtype)
    values = torch.randn(blocks, page, kv_heads, d, generator=g).to(dtype)
    return keys, values


def _tables(lengths, page, blocks, seed=1):
    """Each sequence's block table over shuffled blocks (1.. : 0 is the null block), padded with
    0."""
    g = torch.Generator().manual_seed(seed)
    order = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    width = max(-(-n // page) for n in lengths)
    table = []
    for n in lengths:
        need = -(-n // page)
        table.append(order[:need] + [0] * (width - need))
        order = order[need:]
    return torch.tensor(table)


@pytest.mark.parametrize(
    "dtype,d,softcap,sinks,window",
    [
        (torch.float32, 16, 0.0, False, 0),
        # a head width no power of two, cap, sinks, window mid-block
        (torch.float32, 24, 5.0, True, 7),
        (torch.bfloat16, 32, 0.0, True, 0),
    ],
)
def test_paged_decode(dtype, d, softcap, sinks, window):
    page, heads, kv_heads = 4, 6, 2
    lengths = [1, 9, 23]  # one key; two blocks and a bit; six blocks less one
    keys, values = _cache(20, page, kv_heads, d, dtype)
    table = _tables(lengths, page, 20)
    end = torch.tensor(lengths)
    first = (end - window).clamp(min=0) if window else torch.zeros_like(end)
    q = torch.randn(len(lengths), heads, d).to(dtype)
    head_sinks = torch.randn(heads) if sinks else None
    scale = 0.3  # a layer's own, not 1/sqrt(d)
    want = paged_decode_reference(q, keys, values, table, first, end, scale, softcap, head_sinks)
    on = [
        t.to(DEVICE) if t is not None else None
        for t in (q, keys, values, table, first, end, head_sinks)
    ]
    got = paged_decode(*on[:6], scale, softcap, on[6], splits=3).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_paged_decode_refuses_mismatched_cache():
    keys, values = _cache(4, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="keys: dtype"):
        paged_decode(
            torch.randn(1, 2, 16).bfloat16(),
            keys,
            values,
            torch.ones(1, 1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            1.0,
        )


@pytest.mark.parametrize(
    "dtype,starts,window,softcap,sinks",
    [
        # a whole prompt; a chunk after a prefix that ends mid-block
        (torch.float32, [0, 6], 0, 0.0, False),
        (torch.float32, [3, 13], 5, 4.0, True),  # window shorter than the context, cap, sinks
        (torch.bfloat16, [0, 9], 0, 0.0, False),
    ],
)
def test_paged_extend(dtype, starts, window, softcap, sinks):
    # queries span two query tiles and several blocks
    page, heads, kv_heads, d, queries = 4, 4, 2, 16, 19
    lengths = [s + queries for s in starts]
    keys, values = _cache(24, page, kv_heads, d, dtype)
    table = _tables(lengths, page, 24)
    q = torch.randn(len(starts), heads, queries, d).to(dtype)
    head_sinks = torch.randn(heads) if sinks else None
    starts_t = torch.tensor(starts)
    want = paged_extend_reference(
        q, keys, values, table, starts_t, window, 0.25, softcap, head_sinks
    )
    on = [
        t.to(DEVICE) if t is not None else None
        for t in (q, keys, values, table, starts_t, head_sinks)
    ]
    got = paged_extend(*on[:5], window, 0.25, softcap, on[5]).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype,sinks", [(torch.float32, False), (torch.bfloat16, True)])
def test_mla_decode(dtype, sinks):
    """DeepSeek-V3's MLA shape scaled down: rank 64 (512), rope 16 (64), 20 heads (128: two head
    tiles, the second partial), ragged sequences over blocks of 4, a window's first key
    mid-block."""
    page, heads, rank, rope = 4, 20, 64, 16
    lengths = [2, 11, 18]
    latents, rotated = (
        _cache(16, page, 1, rank, dtype)[0],
        _cache(16, page, 1, rope, dtype, seed=5)[0],
    )
    table = _tables(lengths, page, 16)
    end = torch.tensor(lengths)
    first = torch.tensor([0, 0, 5])
    g = torch.Generator().manual_seed(4)
    q_latent = torch.randn(3, heads, rank, generator=g).to(dtype) / 4
    q_rot = torch.randn(3, heads, rope, generator=g).to(dtype)
    head_sinks = torch.randn(heads) if sinks else None
    want = mla_decode_reference(
        q_latent, q_rot, latents, rotated, table, first, end, 0.2, head_sinks
    )
    on = [
        t.to(DEVICE) if t is not None else None
        for t in (q_latent, q_rot, latents, rotated, table, first, end, head_sinks)
    ]
    got = mla_decode(*on[:7], 0.2, on[7], splits=2).cpu()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)
