"""The causal prefill attention kernel (kernels/causal_attend.cpp): a prompt's queries over the keys
before them (within a window) read where a cache holds them equal masked softmax attention in f64
over the same keys gathered, for grouped heads, chunks that start mid-sequence, scattered blocks,
f32 and bf16; a sequence's output does not depend on its batch or the thread count; and paged and
static-cache prefills take it, one call a layer, equal to the whole read."""

from __future__ import annotations

import pytest
import torch

from tests.native_kernels import built
from tests.tiny_models import SCORES_AT_THE_CAP


@pytest.fixture(scope="module")
def kernel():
    return built("causal_attend", "prefills use torch's attention")


def _reference(q, keys, values, table, starts, window, scale, softcap=0.0):
    """Gather each sequence's keys from its blocks, then masked softmax(q k^T scale) v in f64, each
    score s taken as cap tanh(s / cap) where a soft cap is given (Gemma 2)."""
    n, heads, t, _ = q.shape
    block, group = keys.shape[1], heads // keys.shape[2]
    out = []
    for r in range(n):
        end = int(starts[r]) + t
        slots = [int(table[r, p // block]) * block + p % block for p in range(end)]
        # [heads, keys, d]
        k = keys.flatten(0, 1)[slots].double().transpose(0, 1).repeat_interleave(group, 0)
        v = values.flatten(0, 1)[slots].double().transpose(0, 1).repeat_interleave(group, 0)
        scores = torch.einsum("htd,hkd->htk", q[r].double(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(int(starts[r]), end).view(-1, 1)
        key_pos = torch.arange(end).view(1, -1)
        allowed = key_pos <= query_pos
        if window:
            allowed &= key_pos > query_pos - window
        out.append(
            torch.einsum("htk,hkd->htd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        )
    return torch.stack(out)


def _scattered(gen, n, end, block, kv_heads, d, dv, dtype):
    """A cache of blocks in random order, each sequence its own, holding `end` positions a
    sequence."""
    need = -(-end // block)
    blocks = n * need + 2
    keys = torch.randn(blocks, block, kv_heads, d, generator=gen).to(dtype)
    values = torch.randn(blocks, block, kv_heads, dv, generator=gen).to(dtype)
    table = (torch.randperm(blocks - 1, generator=gen)[: n * need] + 1).view(n, need)
    return keys, values, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "dv"),
    [(9, 3, 64, 64), (4, 4, 40, 32), (8, 1, 17, 16), (16, 2, 128, 128)],
)
def test_equals_masked_softmax_attention_over_the_gathered_keys(
    kernel, dtype, heads, kv_heads, d, dv
):
    gen = torch.Generator().manual_seed(heads * 10 + d)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    # (sequences, queries, first query's position, window, block): a whole prompt; chunks that start
    # mid-sequence; a window shorter than the chunk; one query; a window inside one key tile
    for n, t, start, window, block in (
        (1, 100, 0, 0, 16),
        (2, 37, 5, 0, 4),
        (1, 300, 33, 50, 16),
        (3, 1, 7, 0, 8),
        (1, 64, 0, 7, 16),
    ):
        keys, values, table = _scattered(gen, n, start + t, block, kv_heads, d, dv, dtype)
        # strided, as packed steps hand it
        q = torch.randn(n, t, heads, d, generator=gen).to(dtype).transpose(1, 2)
        starts = torch.full((n,), start)
        got = kernel(q, keys, values, table, starts, window, d**-0.5)
        want = _reference(q, keys, values, table, starts, window, d**-0.5)
        assert got.dtype == dtype and got.shape == (n, heads, t, dv)
        assert ((got.double() - want).norm() / want.norm()).item() < tol, (n, t, start, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_equal_the_capped_masked_softmax(kernel, dtype):
    """Gemma 2's scores capped (cap tanh(s / cap)) before the softmax, over a whole prompt and a
    windowed chunk that starts mid-sequence: the capped reference, which the uncapped one is not."""
    gen = torch.Generator().manual_seed(21)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for n, t, start, window in ((1, 70, 0, 0), (2, 40, 9, 16)):
        keys, values, table = _scattered(gen, n, start + t, 8, 2, 32, 32, dtype)
        keys = keys * 4  # scores of tens: the cap of 5 changes them
        q = (torch.randn(n, 4, t, 32, generator=gen) * 2).to(dtype)
        starts = torch.full((n,), start)
        got = kernel(q, keys, values, table, starts, window, 0.25, 5.0)
        want = _reference(q, keys, values, table, starts, window, 0.25, 5.0)
        assert ((got.double() - want).norm() / want.norm()).item() < tol
        uncapped = _reference(q, keys, values, table, starts, window, 0.25)
        assert ((uncapped - want).norm() / want.norm()).item() > 0.1


def test_a_sequences_output_does_not_depend_on_its_batch_or_the_threads(kernel):
    gen = torch.Generator().manual_seed(8)
    keys, values, table = _scattered(gen, 3, 300, 16, 3, 64, 64, torch.float32)
    q = torch.randn(3, 9, 260, 64, generator=gen)
    starts = torch.tensor([40, 0, 17])
    together = kernel(q, keys, values, table, starts, 0, 0.125)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(kernel(q, keys, values, table, starts, 0, 0.125), together)
            for r in range(3):
                alone = kernel(
                    q[r : r + 1], keys, values, table[r : r + 1], starts[r : r + 1], 0, 0.125
                )
                assert torch.equal(alone[0], together[r])
    finally:
        torch.set_num_threads(threads)


def test_positions_outside_the_table_are_refused(kernel):
    keys = values = torch.zeros(4, 2, 1, 16)
    q = torch.zeros(1, 2, 3, 16)
    with pytest.raises(RuntimeError, match=r"positions \[2, 5\) outside the 4 slots"):
        kernel(q, keys, values, torch.tensor([[1, 2]]), torch.tensor([2]), 0, 1.0)
    with pytest.raises(RuntimeError, match="block 9 outside"):
        kernel(q, keys, values, torch.tensor([[1, 9]]), torch.tensor([0]), 0, 1.0)
    with pytest.raises(RuntimeError, match="a multiple of"):
        kernel(q, keys, torch.zeros(4, 2, 1, 12), torch.tensor([[1, 2]]), torch.tensor([0]), 0, 1.0)


def _calls(seen) -> int:
    return sum(1 for e in seen.events() if e.name == "ster_kernels::causal_attend")


def _without_kernel(monkeypatch, model, *args):
    """model(*args) with the causal kernel turned off: the masked softmax, the reference the kernel
    replaces."""
    from ster_dist.model import step

    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(step, "causal_kernel_fits", lambda q, keys, values: False)
        return model(*args)


# Gemma 2's soft-capped attention (and window of 4 on alternate layers), its scores brought to the
# cap
@pytest.mark.parametrize("variant, change", [("llama", None), ("gemma2", SCORES_AT_THE_CAP)])
def test_a_paged_prefill_reads_keys_in_place_and_equals_the_whole_read(
    kernel, tmp_path, monkeypatch, variant, change
):
    """Two prompts in one step, then one continued from mid-sequence beside a decode: every prompt
    chunk takes the kernel (one call a layer each), and each sequence's logits equal the whole
    read's without the kernel."""
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
    tokens = {name: torch.randint(3, 300, (30,), generator=gen) for name in "AB"}
    driver = Driver(PagedCache(model, 20, BLOCK))
    layers = model.cfg.num_layers
    for step, prompts in (([("A", 7), ("B", 11)], 2), ([("B", 1), ("A", 9)], 1)):
        with profile() as seen:
            chunks, logits = run_step(model, driver, tokens, step)
        assert _calls(seen) == prompts * layers
        for row, ((name, _), c) in enumerate(zip(step, chunks)):
            whole = _without_kernel(monkeypatch, model, tokens[name][None, : c.start + c.length])[
                0, -1
            ]
            assert compare(logits[row], whole)["max_relative_error"] < 1e-5


def test_a_static_cache_prefill_takes_the_kernel_unless_rows_hold_padding(
    kernel, tmp_path, monkeypatch
):
    """generate's prefill over a static cache (and a second chunk after it) takes the kernel, one
    call a layer; a batch whose rows hold padding keeps the masked softmax; all equal the whole read
    without the kernel."""
    from torch.profiler import profile

    from ster_dist.load import load_model
    from ster_dist.parity import compare
    from ster_dist.resolve import resolve
    from tests.tiny_models import make_tiny

    make_tiny("llama", tmp_path / "llama")
    model = load_model(resolve(str(tmp_path / "llama")), "f32").model
    ids = torch.randint(3, 300, (2, 14), generator=torch.Generator().manual_seed(2))
    layers = model.cfg.num_layers
    padded = torch.arange(14) >= torch.tensor([[0], [3]])
    for valid, calls_per_layer in ((torch.ones(2, 14, dtype=torch.bool), 1), (padded, 0)):
        cache = model.new_cache(2, 16)
        with torch.no_grad(), profile() as seen:
            model(ids[:, :9], torch.arange(9).expand(2, -1), valid[:, :9], cache)
            last = model(ids[:, 9:], torch.arange(9, 14).expand(2, -1), valid[:, 9:], cache)[:, -1]
        whole = _without_kernel(monkeypatch, model, ids, torch.arange(14).expand(2, -1), valid)
        assert _calls(seen) == 2 * calls_per_layer * layers
        assert compare(last, whole[:, -1])["max_relative_error"] < 1e-5


def test_a_read_that_trains_keeps_the_masked_softmax_and_its_gradients(
    kernel, tmp_path, monkeypatch
):
    """The kernel has no backward: where a gradient is asked of the queries, keys or values
    (tuning's forward), attention stays torch's, and the gradient is the one without the kernel."""
    from torch.profiler import profile

    from ster_dist.load import load_model
    from ster_dist.resolve import resolve
    from tests.tiny_models import make_tiny

    make_tiny("llama", tmp_path / "llama")
    model = load_model(resolve(str(tmp_path / "llama")), "f32").model
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(4))
    leaves = []

    def leaf(module, args, out):  # the embeddings as a leaf that asks for its gradient
        leaves.append(out.detach().requires_grad_(True))
        return leaves[-1]

    model.embed.register_forward_hook(leaf)
    with profile() as seen:
        model(ids).float().square().sum().backward()
    assert _calls(seen) == 0
    with monkeypatch.context() as m:
        from ster_dist.model import step

        m.setattr(step, "causal_kernel_fits", lambda q, keys, values: False)
        model(ids).float().square().sum().backward()
    assert leaves[0].grad is not None and leaves[0].grad.abs().sum() > 0
    assert torch.equal(leaves[0].grad, leaves[1].grad)
