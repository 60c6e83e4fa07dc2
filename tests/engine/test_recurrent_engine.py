"""The token engine on a model with recurrent layers (a tiny LFM2: short convolutions around
attention): every request of a continuous batch equals its greedy tokens alone by whole re-reads,
with prompts read in chunks under a small token budget, under preemption by recompute (few blocks),
steered beside a plain request, and across two tensor-parallel ranks; each running request holds a
state slot, given back when it finishes, is cancelled or is preempted; slots share the cache budget
with blocks; prefix caching is off and reported so."""

from __future__ import annotations

import pytest
import torch

from ster_dist.config.load import model_config
from ster_dist.engine.blocks import BlockPool
from ster_dist.engine.loop import EngineConfig, TokenEngine, cache_sizes
from ster_dist.engine.sampling import SamplingParams
from ster_dist.engine.scheduler import Scheduler, Sequence
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.resolve import resolve
from ster_dist.steer.attach import add_steering
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.group import LocalGroup
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import alone
from tests.tiny_models import make_tiny


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """variant -> (checkpoint directory, the model on one rank, read whole per token: what each
    request alone must equal), each made once."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            directory = tmp_path_factory.mktemp(variant)
            make_tiny(variant, directory)
            cache[variant] = directory, load_model(resolve(str(directory)), "f32").model
        return cache[variant]

    return get


# lfm2_biased: a kernel of four, biased convolutions; the costlier checks run on lfm2 alone
BOTH = pytest.mark.parametrize("variant", ["lfm2", "lfm2_biased"])


def open_engine(directory, group=None, **config) -> TokenEngine:
    checkpoint = resolve(str(directory))
    group = group or LocalGroup()
    group.call("load", checkpoint, "f32", "cpu")
    cfg = model_config(checkpoint)
    return TokenEngine(
        group,
        cfg,
        Tokenizer.from_directory(checkpoint.directory),
        cfg.eos_token_ids or (2,),
        EngineConfig(**{"kv_cache_memory": 4 << 20, "block_size": 4, **config}),
    )


def prompts(count: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (count,), generator=g).tolist()
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def run_all(engine: TokenEngine, ps: list[list[int]], lengths: list[int]) -> list[list[int]]:
    streams = [
        engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(ps, lengths)
    ]
    return [s.result().token_ids for s in streams]


@BOTH
def test_chunked_prefills_in_a_continuous_batch_equal_each_alone(made, variant):
    directory, reference = made(variant)
    ps = prompts(6, seed=1, lo=3, hi=30)
    lengths = [9, 4, 12, 1, 7, 10]
    # six tokens a step: long prompts are read in several chunks, beside other requests' decodes
    with open_engine(directory, max_step_tokens=6) as engine:
        got = run_all(engine, ps, lengths)
        stats = engine.stats()
        free = engine.scheduler.slots.free
    for p, n, tokens in zip(ps, lengths, got):
        assert tokens == alone(reference, p, n)
    assert stats["state_slots"] == 6 and stats["state_bytes"] > 0
    # every finished request gave its slot and blocks back
    assert free == 6 and stats["kv_blocks"]["used"] == 0
    assert stats["steps"] < sum(lengths)  # requests shared steps


@BOTH
def test_prefix_caching_is_off_and_a_repeated_prompt_is_read_again(made, variant):
    directory, reference = made(variant)
    prompt = prompts(1, seed=2, lo=21, hi=22)[0]
    with open_engine(directory) as engine:  # the engine's default asks for prefix caching
        first = engine.submit(prompt, SamplingParams(max_tokens=5, ignore_eos=True)).result()
        second = engine.submit(prompt, SamplingParams(max_tokens=5, ignore_eos=True)).result()
        stats = engine.stats()
    assert stats["prefix_caching"] is False
    assert second.cached_tokens == 0 and stats["kv_blocks"]["prefix_hits"] == 0
    assert first.token_ids == second.token_ids == alone(reference, prompt, 5)


def test_preemption_under_a_tiny_block_budget_gives_the_same_tokens(made):
    directory, reference = made("lfm2")
    ps = prompts(6, seed=7, lo=8, hi=16)
    with open_engine(directory, max_blocks=16, max_step_tokens=16) as engine:
        got = run_all(engine, ps, [20] * 6)
        stats = engine.stats()
        free = engine.scheduler.slots.free
    assert stats["preemptions"] > 0
    assert free == stats["state_slots"]
    for p, tokens in zip(ps, got):
        assert tokens == alone(reference, p, 20)


@BOTH
def test_a_cancelled_request_gives_its_slot_back_and_the_next_one_starts_fresh(made, variant):
    directory, reference = made(variant)
    first, second = prompts(2, seed=5, lo=6, hi=12)
    # one slot: the next request takes the same one
    with open_engine(directory, max_running=1) as engine:
        stream = engine.submit(first, SamplingParams(max_tokens=100, ignore_eos=True))
        next(stream)
        assert engine.scheduler.slots.free == 0
        stream.cancel()
        assert list(stream)[-1].finish_reason == "abort"
        assert engine.scheduler.slots.free == 1
        after = engine.submit(second, SamplingParams(max_tokens=8, ignore_eos=True)).result()
    assert after.token_ids == alone(reference, second, 8)


def test_a_steered_request_beside_a_plain_one_equals_each_alone(made):
    """A vector after a short-convolution layer changes what the next layers' states hold for that
    request only."""
    directory, reference = made("lfm2")
    vector = [
        (0, torch.randn(reference.cfg.hidden_size, generator=torch.Generator().manual_seed(3)))
    ]
    steered, plain = prompts(2, seed=11, lo=5, hi=15)
    with open_engine(directory, max_step_tokens=8) as engine:
        engine.add_vector("v", vector)
        streams = [
            engine.submit(
                steered, SamplingParams(max_tokens=8, ignore_eos=True), steering=("v", 3.0)
            ),
            engine.submit(plain, SamplingParams(max_tokens=8, ignore_eos=True)),
        ]
        got = [s.result().token_ids for s in streams]
    assert got[1] == alone(reference, plain, 8)
    unsteered = alone(reference, steered, 8)
    removers = add_steering(reference, vector, 3.0)
    try:
        assert got[0] == alone(reference, steered, 8) != unsteered  # the vector took effect
    finally:
        for remove in removers:
            remove()


def test_two_tensor_parallel_ranks_equal_one(made):
    directory, reference = made("lfm2")
    ps = prompts(4, seed=9, lo=3, hi=20)
    lengths = [6, 3, 9, 5]
    with SpawnGroup(2) as group:
        with open_engine(directory, group=group, max_step_tokens=8) as engine:
            got = run_all(engine, ps, lengths)
    for p, n, tokens in zip(ps, lengths, got):
        assert tokens == alone(reference, p, n)


def test_state_slots_share_the_budget_with_blocks():
    config = EngineConfig(block_size=4, max_running=8, max_step_tokens=64)
    plain = [{"budget": 10_000, "block_bytes": 100, "state_bytes": 0}]
    assert cache_sizes(plain, config, 640) == (100, 0)
    # eight slots of 300 bytes leave 7600 bytes of blocks
    assert cache_sizes(
        [{"budget": 10_000, "block_bytes": 100, "state_bytes": 300}], config, 640
    ) == (76, 8)
    # states may take half the budget at most: a rank of big states runs fewer requests at once, and
    # each
    # rank's blocks are what its own states leave
    assert cache_sizes(
        [
            {"budget": 10_000, "block_bytes": 100, "state_bytes": 300},
            {"budget": 10_000, "block_bytes": 100, "state_bytes": 2_000},
        ],
        config,
        640,
    ) == (60, 2)
    # every layer recurrent: blocks cost nothing and are as many as the running requests could fill
    assert cache_sizes([{"budget": 10_000, "block_bytes": 0, "state_bytes": 300}], config, 640) == (
        8 * 160 + 1,
        8,
    )
    with pytest.raises(Refusal, match="recurrent state takes 6000 bytes"):
        cache_sizes([{"budget": 10_000, "block_bytes": 100, "state_bytes": 6_000}], config, 640)


def test_the_scheduler_takes_a_slot_at_admission_and_gives_it_back_on_preemption_and_finish():
    pool = BlockPool(6, 4, prefix_caching=False)  # five usable blocks of four positions
    sched = Scheduler(pool, max_step_tokens=32, max_running=8, state_slots=2)
    assert sched.max_running == 2  # no more running than slots
    a, b, c = (Sequence(name, [5] * 6, 6, 10) for name in "abc")
    for seq in (a, b, c):
        sched.add(seq)
    plan = sched.schedule()
    assert [chunk.seq for chunk in plan.chunks] == [a, b] and (a.state, b.state, c.state) == (
        0,
        1,
        -1,
    )
    sched.after_step(plan)
    for seq in (a, b):
        for _ in range(3):
            sched.append(seq, 7)
    plan = sched.schedule()  # a takes the last block; b finds none and is preempted, its slot back
    assert plan.preempted == [b] and b.state == -1 and sched.slots.free == 1
    sched.after_step(plan)
    sched.finish(a)
    assert a.state == -1 and sched.slots.free == 2
    plan = sched.schedule()
    assert [(chunk.seq, chunk.start) for chunk in plan.chunks] == [(b, 0), (c, 0)] and {
        b.state,
        c.state,
    } == {0, 1}
    with pytest.raises(ValueError, match="cannot share prefixes"):
        Scheduler(BlockPool(6, 4), state_slots=2)
