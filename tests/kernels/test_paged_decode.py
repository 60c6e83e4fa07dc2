"""The paged-decode attention kernel (kernels/paged_decode.cpp): one query per sequence over its
keys read in place from a paged cache equals softmax attention in f64 over the same keys gathered,
for grouped heads, windows and chunks, scattered and shared blocks, f32 and bf16; and a paged engine
step that takes it equals one that gathers."""

from __future__ import annotations

import pytest
import torch

from tests.native_kernels import built
from tests.tiny_models import SCORES_AT_THE_CAP


@pytest.fixture(scope="module")
def kernel():
    return built("paged_decode", "the engine gathers")


def _reference(q, keys, values, table, first, end, scale, softcap=0.0):
    """Gather each sequence's keys from its blocks, then softmax(q k^T scale) v in f64, each score s
    taken as cap tanh(s / cap) where a soft cap is given (Gemma 2)."""
    block = keys.shape[1]
    out = []
    for i in range(q.shape[0]):
        slots = [
            int(table[i, p // block]) * block + p % block for p in range(int(first[i]), int(end[i]))
        ]
        k = keys.flatten(0, 1)[slots].double()  # [keys, kv_heads, d]
        v = values.flatten(0, 1)[slots].double()
        group = q.shape[1] // keys.shape[2]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "dv"), [(6, 2, 64, 64), (4, 4, 40, 24), (8, 1, 17, 33)]
)
def test_in_place_reads_equal_gathered_softmax_attention(kernel, dtype, heads, kv_heads, d, dv):
    gen = torch.Generator().manual_seed(heads * 100 + d)
    blocks, block = 23, 4
    keys = torch.randn(blocks, block, kv_heads, d, generator=gen).to(dtype)
    values = torch.randn(blocks, block, kv_heads, dv, generator=gen).to(dtype)
    lengths = [1, 5, 17, 40, 13]
    width = max(-(-n // block) for n in lengths)
    # each sequence's blocks scattered over the cache, the shorter ones padded with block 0
    order = torch.randperm(blocks - 1, generator=gen) + 1
    table = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        need = -(-n // block)
        # blocks may be shared
        table[i, :need] = order[torch.randint(0, blocks - 1, (need,), generator=gen)]
    q = torch.randn(len(lengths), heads, d, generator=gen).to(dtype)
    end = torch.tensor(lengths)
    scale = d**-0.5
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # every key, a window of 6, chunks of 8
    for first in (torch.zeros_like(end), (end - 6).clamp(min=0), (end - 1) // 8 * 8):
        got = kernel(q, keys, values, table, first, end, scale)
        want = _reference(q, keys, values, table, first, end, scale)
        assert got.dtype == dtype and got.shape == (len(lengths), heads, dv)
        assert ((got.double() - want).norm() / want.norm()).item() < tol


def _scattered_cache(gen, lengths, block, kv_heads, d, dv, dtype, heads):
    """A cache of blocks in random order, every sequence's own (no sharing), and a query per
    sequence."""
    need = [-(-n // block) for n in lengths]
    blocks = sum(need) + 1
    keys = torch.randn(blocks, block, kv_heads, d, generator=gen).to(dtype)
    values = torch.randn(blocks, block, kv_heads, dv, generator=gen).to(dtype)
    order = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lengths), max(need), dtype=torch.long)
    for i, k in enumerate(need):
        table[i, :k] = torch.tensor([order.pop() for _ in range(k)])
    return keys, values, table, torch.randn(len(lengths), heads, d, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_sequences_read_in_pieces_equal_softmax_attention(kernel, dtype):
    """Sequences longer than one piece of keys (256) are read in pieces whose partial softmaxes are
    merged:
    exactly at a piece's edge, one past it, across three pieces, and with a window starting inside a
    piece."""
    gen = torch.Generator().manual_seed(7)
    lengths = [256, 257, 700, 3, 513]
    keys, values, table, q = _scattered_cache(gen, lengths, 16, 2, 32, 48, dtype, 6)
    end = torch.tensor(lengths)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for first in (torch.zeros_like(end), (end - 300).clamp(min=0)):
        got = kernel(q, keys, values, table, first, end, 0.2)
        want = _reference(q, keys, values, table, first, end, 0.2)
        assert ((got.double() - want).norm() / want.norm()).item() < tol


def test_a_sequences_output_does_not_depend_on_its_batch_or_the_threads(kernel):
    """A sequence's attention is the same bits alone, beside others of other lengths, and on one
    thread or two: where its keys are cut into pieces depends on its own length only (a request's
    logits must not depend on what shares its step)."""
    gen = torch.Generator().manual_seed(8)
    lengths = [600, 40, 1000, 257]
    keys, values, table, q = _scattered_cache(gen, lengths, 8, 3, 64, 64, torch.float32, 9)
    end, first = torch.tensor(lengths), torch.zeros(len(lengths), dtype=torch.long)
    together = kernel(q, keys, values, table, first, end, 0.125)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(kernel(q, keys, values, table, first, end, 0.125), together)
            for i in range(len(lengths)):
                alone = kernel(
                    q[i : i + 1],
                    keys,
                    values,
                    table[i : i + 1],
                    first[i : i + 1],
                    end[i : i + 1],
                    0.125,
                )
                assert torch.equal(alone[0], together[i])
    finally:
        torch.set_num_threads(threads)


def test_keys_outside_the_table_are_refused(kernel):
    keys = values = torch.zeros(4, 2, 1, 8)
    table = torch.tensor([[1, 2]])
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="outside the 4 slots"):
        kernel(q, keys, values, table, torch.tensor([0]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="block 9 outside"):
        kernel(q, keys, values, torch.tensor([[1, 9]]), torch.tensor([0]), torch.tensor([3]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_planned_step_stores_each_rows_key_then_attends_as_the_kernel(kernel, dtype):
    """attend_planned (a compiled decode step's attention, model/compiled.py) with packed rows [1,
    heads, rows, d]: each row's new key and value land at its slot, and the output is paged_decode's
    over the updated cache, laid out as q; a layer the plan leaves out (scale 0) and a step with no
    plan go to ster_dist::attend instead."""
    from ster_dist.model import compiled  # noqa: F401  (defines ster_dist::attend, where unplanned layers go)

    gen = torch.Generator().manual_seed(9)
    lengths = [3, 9, 70]
    keys, values, table, _ = _scattered_cache(gen, lengths, 4, 2, 16, 24, dtype, 6)
    end = torch.tensor(lengths)
    last = end - 1  # each row's new token is its last position
    blocks = table.gather(1, (last // 4).view(-1, 1)).view(-1)
    slots = last % 4
    q = torch.randn(1, 6, 3, 16, generator=gen).to(dtype)
    k = torch.randn(1, 2, 3, 16, generator=gen).to(dtype)
    v = torch.randn(1, 2, 3, 24, generator=gen).to(dtype)
    want_keys, want_values = keys.clone(), values.clone()
    for r in range(3):
        want_keys[blocks[r], slots[r]] = k[0, :, r]
        want_values[blocks[r], slots[r]] = v[0, :, r]
    want = kernel(
        q[0].transpose(0, 1), want_keys, want_values, table, torch.zeros_like(end), end, 0.25
    )
    ops = torch.ops.ster_kernels
    ops.push_plan(
        [keys, keys],
        [values, values],
        [0.25, 0.0],
        blocks,
        slots,
        table,
        torch.zeros_like(end),
        end,
        True,
    )
    try:
        got = ops.attend_planned(q, k, v, torch.tensor(0))
        with pytest.raises(Exception, match="index out of range"):
            # not planned: Python's operator, with no step running
            ops.attend_planned(q, k, v, torch.tensor(1))
    finally:
        ops.pop_plan()
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert got.shape == (1, 6, 3, 24) and got.is_contiguous()
    assert torch.equal(got, want.transpose(0, 1).unsqueeze(0))


def test_a_planned_layer_keeps_to_its_window_and_its_chunk(kernel):
    """A plan's windowed layer (Mistral's, Gemma's local ones) reads each row's last `window` keys,
    a chunked one (Llama 4's) those of the new token's own chunk, both where both are set: the first
    key of each row as the eager mask has it (a key at distance < window, in the query's chunk), and
    the reference's softmax over them."""
    gen = torch.Generator().manual_seed(12)
    lengths = [3, 9, 70, 130]
    keys, values, table, _ = _scattered_cache(gen, lengths, 4, 2, 16, 16, torch.float32, 4)
    end = torch.tensor(lengths)
    last = end - 1
    blocks, slots = table.gather(1, (last // 4).view(-1, 1)).view(-1), last % 4
    q = torch.randn(1, 4, 4, 16, generator=gen)
    k, v = torch.randn(1, 2, 4, 16, generator=gen), torch.randn(1, 2, 4, 16, generator=gen)
    ops = torch.ops.ster_kernels
    ranges = {
        (0, 0): torch.zeros_like(end),
        (5, 0): (end - 5).clamp(min=0),
        (0, 8): last // 8 * 8,
        (50, 64): torch.maximum((end - 50).clamp(min=0), last // 64 * 64),
    }
    ops.push_plan(
        [keys] * 4,
        [values] * 4,
        [0.25] * 4,
        blocks,
        slots,
        table,
        torch.zeros_like(end),
        end,
        True,
        [w for w, _ in ranges],
        [c for _, c in ranges],
    )
    try:
        got = [ops.attend_planned(q, k, v, torch.tensor(layer)) for layer in range(4)]
    finally:
        ops.pop_plan()
    for out, first in zip(got, ranges.values()):
        want = _reference(q[0].transpose(0, 1), keys, values, table, first, end, 0.25)
        assert ((out[0].transpose(0, 1).double() - want).norm() / want.norm()).item() < 1e-5
        assert torch.equal(
            out[0].transpose(0, 1),
            kernel(q[0].transpose(0, 1), keys, values, table, first, end, 0.25),
        )
    assert not torch.allclose(got[0], got[1])  # the window did cut
    with pytest.raises(RuntimeError, match="one window, one chunk and one soft cap a layer"):
        ops.push_plan(
            [keys],
            [values],
            [0.25],
            blocks,
            slots,
            table,
            torch.zeros_like(end),
            end,
            True,
            [1, 2],
            [],
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_equal_the_capped_softmax_read_directly_or_planned(kernel, dtype):
    """Gemma 2's attention logits capped (cap tanh(s / cap)) before the softmax: the kernel called
    directly and a plan's capped layer both equal the f64 reference, over several pieces of keys and
    within a window; a layer without a cap beside it stays uncapped; a cap list of the wrong length
    is refused."""
    gen = torch.Generator().manual_seed(13)
    lengths = [5, 70, 300]
    keys, values, table, _ = _scattered_cache(gen, lengths, 8, 2, 16, 16, dtype, 4)
    keys = keys * 4  # scores of tens: the cap of 5 changes them
    end = torch.tensor(lengths)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    q = (torch.randn(len(lengths), 4, 16, generator=gen) * 2).to(dtype)
    for first in (torch.zeros_like(end), (end - 40).clamp(min=0)):
        got = kernel(q, keys, values, table, first, end, 0.25, 5.0)
        want = _reference(q, keys, values, table, first, end, 0.25, 5.0)
        assert ((got.double() - want).norm() / want.norm()).item() < tol
        uncapped = _reference(q, keys, values, table, first, end, 0.25)
        assert ((uncapped - want).norm() / want.norm()).item() > 0.1  # the cap mattered
    last = end - 1
    blocks, slots = table.gather(1, (last // 8).view(-1, 1)).view(-1), last % 8
    k = torch.randn(1, 2, 3, 16, generator=gen).to(dtype)
    v = torch.randn(1, 2, 3, 16, generator=gen).to(dtype)
    packed_q = q.transpose(0, 1).unsqueeze(0)  # [1, heads, rows, d]
    ops = torch.ops.ster_kernels
    ops.push_plan(
        [keys] * 2,
        [values] * 2,
        [0.25] * 2,
        blocks,
        slots,
        table,
        torch.zeros_like(end),
        end,
        True,
        [],
        [],
        [5.0, 0.0],
    )
    try:
        capped, plain = (
            ops.attend_planned(packed_q, k, v, torch.tensor(layer))[0].transpose(0, 1)
            for layer in (0, 1)
        )
    finally:
        ops.pop_plan()
    first = torch.zeros_like(end)
    assert torch.equal(capped, kernel(q, keys, values, table, first, end, 0.25, 5.0))
    assert torch.equal(plain, kernel(q, keys, values, table, first, end, 0.25))
    with pytest.raises(RuntimeError, match="one soft cap a layer"):
        ops.push_plan(
            [keys],
            [values],
            [0.25],
            blocks,
            slots,
            table,
            torch.zeros_like(end),
            end,
            True,
            [],
            [],
            [5.0, 5.0],
        )


def test_a_plan_writing_outside_the_cache_is_refused(kernel):
    keys = values = torch.zeros(4, 2, 1, 8)
    table, ends = torch.tensor([[1, 2]]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="writes outside layer 0"):
        torch.ops.ster_kernels.push_plan(
            [keys],
            [values],
            [1.0],
            torch.tensor([4]),
            torch.tensor([0]),
            table,
            torch.tensor([0]),
            ends,
            True,
        )
    with pytest.raises(RuntimeError, match="writes outside layer 0"):
        torch.ops.ster_kernels.push_plan(
            [keys],
            [values],
            [1.0],
            torch.tensor([1]),
            torch.tensor([2]),
            table,
            torch.tensor([0]),
            ends,
            True,
        )


# Gemma 2's soft-capped attention (and sliding window of 4 on alternate layers), its scores brought
# to the cap
@pytest.mark.parametrize("variant, change", [("llama", None), ("gemma2", SCORES_AT_THE_CAP)])
def test_a_paged_decode_step_reads_keys_in_place_and_equals_the_whole_read(
    kernel, tmp_path, variant, change
):
    from torch.profiler import profile

    from ster_dist.load import load_model
    from ster_dist.model.paged import PagedCache
    from ster_dist.parity import compare
    from ster_dist.resolve import resolve
    from tests.paged_steps import BLOCK, Driver, run_step
    from tests.tiny_models import make_tiny, with_config

    make_tiny(variant, tmp_path / variant)
    directory = (
        with_config(tmp_path / variant, tmp_path / "changed", change)
        if change
        else tmp_path / variant
    )
    model = load_model(resolve(str(directory)), "f32").model
    gen = torch.Generator().manual_seed(1)
    tokens = {name: torch.randint(3, 300, (20,), generator=gen) for name in "AB"}
    driver = Driver(PagedCache(model, 20, BLOCK))
    run_step(model, driver, tokens, [("A", 7), ("B", 11)])
    with profile() as seen:
        chunks, logits = run_step(model, driver, tokens, [("B", 1), ("A", 1)])
    calls = [e for e in seen.events() if e.name == "ster_kernels::paged_decode"]
    assert len(calls) == model.cfg.num_layers  # one call a layer for both decodes, no gather
    for row, (name, c) in enumerate(zip("BA", chunks)):
        with torch.no_grad():
            whole = model(tokens[name][None, : c.start + c.length])[0, -1]
        assert compare(logits[row], whole)["max_relative_error"] < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_static_cache_seen_as_one_block_a_row_is_read_through_its_strides(kernel, dtype):
    """A static cache [batch, kv_heads, capacity, d] viewed [batch, capacity, kv_heads, d] (not
    contiguous) is a paged cache of one block a row: read in place, it equals the same keys copied
    contiguous."""
    gen = torch.Generator().manual_seed(3)
    batch, kv_heads, capacity, d, used = 3, 2, 32, 16, 21
    keys = torch.randn(batch, kv_heads, capacity, d, generator=gen).to(dtype)[:, :, :used]
    values = torch.randn(batch, kv_heads, capacity, d, generator=gen).to(dtype)[:, :, :used]
    q = torch.randn(batch, 6, d, generator=gen).to(dtype)
    rows, first, end = (
        torch.arange(batch).view(batch, 1),
        torch.zeros(batch, dtype=torch.long),
        torch.full((batch,), used),
    )
    strided = kernel(q, keys.transpose(1, 2), values.transpose(1, 2), rows, first, end, 0.25)
    copied = kernel(
        q,
        keys.transpose(1, 2).contiguous(),
        values.transpose(1, 2).contiguous(),
        rows,
        first,
        end,
        0.25,
    )
    assert not keys.transpose(1, 2).is_contiguous()
    assert torch.equal(strided, copied)
    want = _reference(
        q,
        keys.transpose(1, 2).contiguous(),
        values.transpose(1, 2).contiguous(),
        rows,
        first,
        end,
        0.25,
    )
    assert ((strided.double() - want).norm() / want.norm()).item() < (
        1e-5 if dtype == torch.float32 else 2e-2
    )


def test_a_static_cache_decode_step_reads_keys_in_place_and_equals_the_whole_read(kernel, tmp_path):
    """One token a row over the keys of a static cache (generate's decode steps) takes the kernel,
    one call a layer, whether every key is real or a row is left-padded (a ragged batch: it reads
    from its first real key); a row with padding between its keys keeps the masked softmax; all
    equal the whole read."""
    from torch.profiler import profile

    from ster_dist.load import load_model
    from ster_dist.parity import compare
    from ster_dist.resolve import resolve
    from tests.tiny_models import make_tiny

    make_tiny("llama", tmp_path / "llama")
    model = load_model(resolve(str(tmp_path / "llama")), "f32").model
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    holed = torch.ones(2, 11, dtype=torch.bool)
    holed[1, 4:6] = False
    for valid, calls_per_layer in (
        (torch.ones(2, 11, dtype=torch.bool), 1),
        (torch.arange(11) >= torch.tensor([[0], [3]]), 1),
        (holed, 0),
    ):
        cache = model.new_cache(2, 16)
        with torch.no_grad():
            model(ids[:, :11], torch.arange(11).expand(2, -1), valid, cache)
            with profile() as seen:
                last = model(
                    ids[:, 11:], torch.full((2, 1), 11), torch.ones(2, 1, dtype=torch.bool), cache
                )[:, -1]
            whole = model(
                ids,
                torch.arange(12).expand(2, -1),
                torch.cat((valid, torch.ones(2, 1, dtype=torch.bool)), 1),
            )
        calls = [e for e in seen.events() if e.name == "ster_kernels::paged_decode"]
        assert len(calls) == calls_per_layer * model.cfg.num_layers
        assert compare(last, whole[:, -1])["max_relative_error"] < 1e-5
