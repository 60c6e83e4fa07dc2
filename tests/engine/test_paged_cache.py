"""The paged KV cache and the packed forward: every step's logits equal the static path's over the
whole sequence so far, for families that exercise each attention switch (grouped and multi-query
heads, sliding windows, soft-capping, sinks, ALiBi, learned positions, Llama 4's query temperature,
experts, latent attention) and a recurrent kind's state slots (LFM2's short convolutions); a mixed
step equals its chunks run one by one; released sliding-window blocks may be reused; block_bytes is
what the cache allocates; tensor- and expert-parallel ranks agree with one."""

from __future__ import annotations

import pytest
import torch

from ster_dist.load import load_model
from ster_dist.model.paged import Chunk, PagedCache
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.paged_steps import BLOCK, Driver, PagedOnRank, run_step
from tests.tiny_models import TINY, make_tiny

VARIANTS = [
    "llama",  # grouped-query heads, llama3 rope
    "falcon_mq",  # one key-value head for all, parallel block
    "gemma2",  # sliding window on alternate layers, attention and final soft-capping
    "gemma3_text",  # sliding pattern, per-head query/key norms
    "gpt_oss",  # sinks, sliding layers, experts
    "bloom",  # ALiBi
    "opt",  # learned positions
    "mixtral",  # experts, sliding window everywhere
    "qwen3_moe",  # experts after a dense layer
    "deepseek_v3",  # latent attention: absorbed decodes, expanded prefills
    "ministral3",  # Llama 4's query temperature, sliding everywhere
    # short convolutions beside attention: a state slot per sequence, continued chunk by chunk
    "lfm2",
    # chunked attention on rotating layers, query temperature on unrotated ones, input-weighed
    # experts
    "llama4_text",
    # key-value heads per layer, values narrower than keys, sinks on sliding layers only
    "mimo_v2_flash",
    "laguna",  # query heads per layer, a softplus gate per head
    # AltUp's copies and per-layer inputs, layers attending an earlier layer's keys and values
    "gemma3n_text",
    # head widths per layer, values from keys, layers reusing earlier layers' keys, per-layer inputs
    "gemma4_text",
]
# one step = (sequence, new tokens) in chunk order: uneven prefill chunks first, decodes mixed in,
# then decodes out of order and not adjacent in the packed tokens, then all sequences decoding
# together
SCHEDULE = [
    [("A", 5), ("B", 3)],
    [("C", 9), ("B", 4), ("A", 6)],
    [("B", 1), ("C", 7), ("A", 2)],
    [("A", 1), ("C", 6), ("B", 1)],
    *[[("A", 1), ("B", 1), ("C", 1)]] * 3,
    [("C", 1), ("A", 1), ("B", 1)],
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            directory = tmp_path_factory.mktemp(variant)
            make_tiny(variant, directory)
            made[variant] = resolve(str(directory))
        return made[variant]

    return get


@pytest.fixture(scope="module")
def models(checkpoints):
    built = {}

    def get(variant: str):
        if variant not in built:
            built[variant] = load_model(checkpoints(variant), "f32").model
        return built[variant]

    return get


def _tokens(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randint(3, 300, (40,), generator=gen) for name in "ABC"}


def _whole(model, tokens, name: str, end: int) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens[name][None, :end])[0, -1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_steps_match_the_whole_sequence(models, variant):
    model = models(variant)
    driver, tokens = Driver(PagedCache(model, 40, BLOCK, state_slots=3)), _tokens()
    for step in SCHEDULE:
        chunks, logits = run_step(model, driver, tokens, step)
        assert logits.shape == (len(step), model.cfg.vocab_size)
        for row, ((name, _), c) in enumerate(zip(step, chunks)):
            result = compare(logits[row], _whole(model, tokens, name, c.start + c.length))
            assert result["max_relative_error"] < 1e-5, (variant, step, name, result)


@pytest.mark.parametrize("variant", ["llama", "deepseek_v3", "bloom"])
def test_a_mixed_step_equals_its_chunks_one_by_one(models, variant):
    model = models(variant)
    tokens = _tokens(1)
    caches = [PagedCache(model, 30, BLOCK), PagedCache(model, 30, BLOCK)]
    drivers = [Driver(cache, seed=3) for cache in caches]
    prefill = [("A", 6), ("B", 9)]
    for driver in drivers:
        run_step(model, driver, tokens, prefill)
    mixed = [("A", 1), ("C", 11), ("B", 1)]
    _, together = run_step(model, drivers[0], tokens, mixed)
    apart = torch.cat([run_step(model, drivers[1], tokens, [part])[1] for part in mixed])
    assert compare(together, apart)["max_relative_error"] < 1e-5
    # and both wrote the same keys where the driver put them
    for layer in range(model.cfg.num_layers):
        torch.testing.assert_close(caches[0].keys[layer], caches[1].keys[layer], rtol=0, atol=1e-6)
        torch.testing.assert_close(
            caches[0].values[layer], caches[1].values[layer], rtol=0, atol=1e-6
        )


def test_longrope_picks_each_sequences_own_table(monkeypatch, tmp_path):
    """A sequence past the switch point beside ones short of it: each rotates as when stepped
    alone."""
    # Phi-3's own key sets the switch point: 32, not 4096
    config_cls, model_cls, kwargs = TINY["phi3"]
    monkeypatch.setitem(
        TINY, "phi3", (config_cls, model_cls, {**kwargs, "original_max_position_embeddings": 32})
    )
    make_tiny("phi3", tmp_path)
    model = load_model(resolve(str(tmp_path)), "f32").model
    rope = model.cfg.layer_rope[0]
    assert rope.rope_type == "longrope" and rope.original_max_position == 32
    tokens, driver = _tokens(8), Driver(PagedCache(model, 40, BLOCK))
    for step in ([("A", 34)], [("B", 5)], [("A", 1), ("B", 1), ("C", 3)], [("C", 1), ("A", 1)]):
        chunks, logits = run_step(model, driver, tokens, step)
        for row, ((name, _), c) in enumerate(zip(step, chunks)):
            result = compare(logits[row], _whole(model, tokens, name, c.start + c.length))
            assert result["max_relative_error"] < 1e-5, (step, name, result)


@pytest.mark.parametrize("variant", ["mistral", "ministral3"])
def test_blocks_outside_every_window_can_be_released_and_reused(models, variant):
    model = models(variant)
    windows = model.cfg.layer_window
    assert all(w is not None for w in windows), "the test needs every layer to slide"
    window, tokens = max(windows), _tokens(2)
    kept, released = Driver(PagedCache(model, 40, BLOCK)), Driver(PagedCache(model, 40, BLOCK))
    nulled: set[int] = set()

    def release(c: Chunk) -> Chunk:
        # a block is out of reach when its last position is outside the window of this chunk's first
        # query
        blocks = tuple(
            PagedCache.NULL_BLOCK if (i + 1) * BLOCK - 1 <= c.start - window else b
            for i, b in enumerate(c.blocks)
        )
        nulled.update(b for b, new in zip(c.blocks, blocks) if new != b)
        return Chunk(blocks, c.start, c.length)

    for step in SCHEDULE:
        _, expected = run_step(model, kept, tokens, step)
        _, logits = run_step(model, released, tokens, step, release)
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
        # the driver may hand a released block to another sequence: scribble on it
        for block in nulled:
            for store in released.cache.keys + released.cache.values:
                store[block].normal_()
    assert nulled, "no block ever left the window: the test saw nothing"


@pytest.mark.parametrize("variant", ["llama", "deepseek_v3"])
def test_block_bytes_are_what_the_cache_allocates(models, variant):
    model = models(variant)
    for dtype in (None, torch.bfloat16):
        cache = PagedCache(model, 7, 5, dtype)
        allocated = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
        assert allocated == 7 * PagedCache.block_bytes(model, 5, dtype)
    # the latent and the shared key part (one shared "head"), not per-head keys
    if variant == "deepseek_v3":
        mla = model.cfg.mla
        assert cache.keys[0].shape == (7, 5, 1, mla.kv_lora_rank)
        assert cache.values[0].shape == (7, 5, 1, mla.qk_rope_head_dim)
    else:
        attn = model.layers[0].attn
        assert cache.keys[0].shape == (7, 5, attn.local_kv, attn.head_dim)


def test_a_cache_narrower_than_the_model_attends_in_the_models_dtype(models):
    model = models("llama")
    tokens, driver = _tokens(7), Driver(PagedCache(model, 40, BLOCK, torch.bfloat16))
    for step in SCHEDULE[:5]:
        chunks, logits = run_step(model, driver, tokens, step)
        assert logits.dtype == torch.float32
        # bf16 keys: about 1e-2 off, not more
        for row, ((name, _), c) in enumerate(zip(step, chunks)):
            assert (
                compare(logits[row], _whole(model, tokens, name, c.start + c.length))[
                    "max_relative_error"
                ]
                < 3e-2
            )


def test_hooks_see_the_packed_residual_and_steer_it(models):
    model = models("llama")
    tokens, seen = _tokens(4), []
    push = torch.randn(model.cfg.hidden_size, generator=torch.Generator().manual_seed(5))

    def steer(h):
        seen.append(tuple(h.shape))
        return h + push

    remove = model.add_hook(1, steer)
    try:
        driver = Driver(PagedCache(model, 20, BLOCK))
        chunks, logits = run_step(model, driver, tokens, [("A", 7), ("B", 1)])
        assert seen == [(1, 8, model.cfg.hidden_size)]
        for row, name in enumerate("AB"):
            c = chunks[row]
            assert (
                compare(logits[row], _whole(model, tokens, name, c.start + c.length))[
                    "max_relative_error"
                ]
                < 1e-5
            )
    finally:
        remove()


def test_bad_chunks_are_refused(models):
    model = models("llama")
    cache = PagedCache(model, 8, BLOCK)
    ids = torch.arange(3, 8)
    with pytest.raises(ValueError, match="blocks"):  # 5 tokens need two blocks
        model.forward_paged(ids, [Chunk((3,), 0, 5)], cache)
    with pytest.raises(ValueError, match="null block"):
        model.forward_paged(ids, [Chunk((3, PagedCache.NULL_BLOCK), 0, 5)], cache)
    with pytest.raises(ValueError, match="new tokens"):
        model.forward_paged(ids[:4], [Chunk((3, 4), 0, 5)], cache)


def test_tensor_parallel_ranks_keep_their_own_heads_and_agree_with_one_rank(checkpoints, models):
    """Each rank caches only its key-value heads (latent attention: the whole latent) under the same
    block ids; the gathered logits equal one rank's."""
    tokens = _tokens(6)
    with SpawnGroup(2) as group:
        for variant in ("llama", "gpt_oss", "deepseek_v3"):
            group.call("load", checkpoints(variant), "f32", "cpu")
            ranks = group.on(PagedOnRank).run(tokens, SCHEDULE, 40)
            model = models(variant)
            single = Driver(PagedCache(model, 40, BLOCK))
            for step, tp2 in zip(SCHEDULE, ranks[0]["logits"]):
                assert (
                    compare(tp2, run_step(model, single, tokens, step)[1])["max_relative_error"]
                    < 1e-5
                )
            whole = tuple(single.cache.keys[0].shape)
            if model.cfg.mla is None:
                assert [r["key_shape"] for r in ranks] == [
                    (*whole[:2], whole[2] // 2, whole[3])
                ] * 2
            else:
                assert [r["key_shape"] for r in ranks] == [whole] * 2


def test_expert_parallel_ranks_take_shares_of_the_packed_tokens(checkpoints, models):
    """Experts route the packed tokens of a step, split over two expert-parallel ranks, as one rank
    does."""
    tokens = _tokens(9)
    with SpawnGroup(2, ep=2) as group:
        group.call("load", checkpoints("qwen3_moe"), "f32", "cpu")
        ranks = group.on(PagedOnRank).run(tokens, SCHEDULE, 40)
    model = models("qwen3_moe")
    single = Driver(PagedCache(model, 40, BLOCK))
    for step, ep2 in zip(SCHEDULE, ranks[0]["logits"]):
        assert compare(ep2, run_step(model, single, tokens, step)[1])["max_relative_error"] < 1e-5
