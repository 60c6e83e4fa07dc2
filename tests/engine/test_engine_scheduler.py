"""The step scheduler, driven by a fake engine loop: every sampling chunk yields one made-up token,
and a sequence finishes at max_tokens. Block bookkeeping is checked against the pool every step."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from ster_dist.engine.blocks import NULL_BLOCK, BlockPool
from ster_dist.engine.scheduler import Scheduler, Sequence, Status, StepPlan

_fresh_tokens = itertools.count(10_000, 1000)


def make_seq(name: str, prompt_len: int, max_tokens: int, first: int | None = None) -> Sequence:
    """A prompt of consecutive tokens; by default from a range no other test prompt shares, so
    nothing hits the prefix cache by accident."""
    first = next(_fresh_tokens) if first is None else first
    return Sequence(
        id=name,
        tokens=list(range(first, first + prompt_len)),
        prompt_len=prompt_len,
        max_tokens=max_tokens,
    )


def fake_token(seq: Sequence) -> int:
    return 100_000 + len(seq.tokens)  # deterministic, distinct from prompt tokens


def check_invariants(sched: Scheduler) -> None:
    pool = sched.pool
    holders: Counter[int] = Counter()
    for seq in sched.running:
        assert seq.status is Status.RUNNING
        assert 0 <= seq.computed <= len(seq.tokens)
        assert len(seq.blocks) * pool.block_size >= seq.computed
        holders.update(b for b in seq.blocks if b != NULL_BLOCK)
        if sched.window is None:
            assert NULL_BLOCK not in seq.blocks
        else:  # only blocks wholly outside the window are gone
            first_live = max(0, seq.computed - sched.window) // pool.block_size
            assert all(b != NULL_BLOCK for b in seq.blocks[first_live:])
    for seq in sched.waiting:
        assert seq.status is Status.WAITING and seq.blocks == [] and seq.computed == 0
    for block in range(1, pool.num_blocks):
        assert pool.refs(block) == holders[block], f"block {block}"
    s = pool.stats()
    assert s["used"] == len(holders)
    assert s["used"] + s["cached"] + s["free"] == s["total"]
    assert len(sched.running) <= sched.max_running


def step(sched: Scheduler, done: list[Sequence] | None = None) -> StepPlan:
    """One turn of the engine loop."""
    plan = sched.schedule()
    assert plan.num_tokens <= sched.max_step_tokens
    for chunk in plan.chunks:
        assert chunk.length >= 1 and chunk.start == chunk.seq.computed
        assert chunk.samples == (chunk.start + chunk.length == len(chunk.seq.tokens))
    sched.after_step(plan)
    for chunk in plan.chunks:
        if chunk.samples:
            sched.append(chunk.seq, fake_token(chunk.seq))
            if chunk.seq.num_generated == chunk.seq.max_tokens:
                sched.finish(chunk.seq)
                if done is not None:
                    done.append(chunk.seq)
    check_invariants(sched)
    return plan


def run_all(sched: Scheduler, max_steps: int = 100_000) -> tuple[list[Sequence], list[StepPlan]]:
    done, plans = [], []
    while sched.has_work:
        plan = step(sched, done)
        assert not plan.is_empty, "work left but nothing scheduled"
        plans.append(plan)
        assert len(plans) < max_steps
    return done, plans


def expected_output(seq: Sequence) -> list[int]:
    return [100_000 + seq.prompt_len + i for i in range(seq.max_tokens)]


# ---- budget and chunking


def test_token_budget_respected_every_step():
    sched = Scheduler(BlockPool(200, 4), max_step_tokens=16)
    seqs = [make_seq(f"s{i}", 5 + 7 * i, 3) for i in range(8)]
    for seq in seqs:
        sched.add(seq)
    done, plans = run_all(sched)
    assert all(p.num_tokens <= 16 for p in plans)
    assert any(p.num_tokens == 16 for p in plans)
    assert sorted(s.id for s in done) == sorted(s.id for s in seqs)
    assert all(s.output == expected_output(s) for s in seqs)


def test_long_prompt_prefilled_in_chunks():
    sched = Scheduler(BlockPool(100, 4), max_step_tokens=16)
    seq = make_seq("long", 50, 2)
    sched.add(seq)
    spans = []
    while sched.has_work:
        plan = step(sched)
        spans += [(c.start, c.length, c.samples) for c in plan.chunks]
    assert spans == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True), (50, 1, True)]
    assert seq.output == expected_output(seq)


def test_max_prefill_chunk_caps_a_chunk():
    sched = Scheduler(BlockPool(100, 4), max_step_tokens=64, max_prefill_chunk=10)
    a, b = make_seq("a", 25, 1), make_seq("b", 5, 1)
    sched.add(a)
    sched.add(b)
    plan = step(sched)
    assert [(c.seq.id, c.start, c.length) for c in plan.chunks] == [("a", 0, 10), ("b", 0, 5)]


def test_decodes_go_before_admissions():
    sched = Scheduler(BlockPool(100, 4), max_step_tokens=8)
    a = make_seq("a", 4, 10)
    sched.add(a)
    step(sched)  # a prefilled, one token sampled
    b = make_seq("b", 20, 1)
    sched.add(b)
    plan = step(sched)
    assert [(c.seq.id, c.start, c.length) for c in plan.chunks] == [("a", 5 - 1, 1), ("b", 0, 7)]


def test_admission_is_fifo():
    # 6 usable blocks of 4: "big" needs 5, so it waits while "first" holds 2; "small" behind it
    # waits too
    sched = Scheduler(BlockPool(7, 4), max_step_tokens=64)
    first, big, small = make_seq("first", 8, 1), make_seq("big", 17, 1), make_seq("small", 2, 1)
    first.max_tokens = 4
    for seq in (first, big, small):
        sched.add(seq)
    plan = step(sched)
    assert [c.seq.id for c in plan.chunks] == ["first"]
    assert [s.id for s in sched.waiting] == ["big", "small"]
    done, _ = run_all(sched)
    assert [s.id for s in done] == ["first", "big", "small"]


def test_max_running_limits_admission():
    sched = Scheduler(BlockPool(100, 4), max_step_tokens=64, max_running=2)
    for i in range(4):
        sched.add(make_seq(f"s{i}", 3, 5))
    step(sched)
    assert [s.id for s in sched.running] == ["s0", "s1"]
    done, _ = run_all(sched)
    assert len(done) == 4


# ---- preemption


def test_preemption_under_a_tiny_pool_completes_everyone():
    # 8 usable blocks of 4 = 32 tokens; four sequences of 12 + 12 would need 6 blocks each
    pool = BlockPool(9, 4)
    sched = Scheduler(pool, max_step_tokens=32)
    seqs = [make_seq(f"s{i}", 12, 12, first=1000 * i) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    done, plans = run_all(sched)
    preempted = [s for p in plans for s in p.preempted]
    assert preempted, "the pool was meant to run short"
    assert all(s.status is Status.WAITING or s.preemptions for s in preempted)
    assert sorted(s.id for s in done) == [s.id for s in seqs]
    for seq in seqs:
        assert seq.output == expected_output(seq) and seq.status is Status.FINISHED
    assert pool.stats()["used"] == 0
    assert sched.stats()["preemptions"] == len(preempted)


def test_preemption_takes_the_latest_arrival_and_requeues_it_first():
    pool = BlockPool(5, 2)  # 4 usable blocks
    sched = Scheduler(pool, max_step_tokens=16)
    a, b = make_seq("a", 4, 4), make_seq("b", 4, 4)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: 2 blocks each, pool full
    c = make_seq("c", 2, 1)
    sched.add(c)
    plan = step(sched)  # a decodes at position 4 and needs a third block: b goes
    assert plan.preempted == [b]
    assert [ch.seq.id for ch in plan.chunks] == ["a"]
    assert [s.id for s in sched.waiting] == ["b", "c"]
    assert b.computed == 0 and b.blocks == [] and b.preemptions == 1 and b.status is Status.WAITING
    assert b.output == [100_000 + 4]  # its sampled token survives, to be recomputed
    done, plans = run_all(sched)
    first_with_c = next(p for p in plans if any(ch.seq is c for ch in p.chunks))
    assert [ch.seq.id for ch in first_with_c.chunks][-2:] == ["b", "c"]  # b re-admitted first
    assert sorted(s.id for s in done) == ["a", "b", "c"]
    assert b.output == expected_output(b)


def test_a_preempted_sequence_recomputes_prompt_and_output_with_cache_help():
    pool = BlockPool(7, 2)  # 6 usable blocks
    sched = Scheduler(pool, max_step_tokens=16)
    a, b = make_seq("a", 4, 5), make_seq("b", 4, 5)
    sched.add(a)
    sched.add(b)
    plans = [step(sched) for _ in range(4)]
    # at position 6 a needs a 4th block: b (7 tokens, 6 computed, 3 blocks registered) goes
    assert plans[-1].preempted == [b] and b.status is Status.WAITING
    assert b.tokens[4:] == b.output and len(b.tokens) == 7
    resumed = None
    while resumed is None:
        plan = sched.schedule()
        resumed = next((c for c in plan.chunks if c.seq is b), None)
        if resumed is None:  # finish the turn the ordinary way
            sched.after_step(plan)
            for chunk in (c for c in plan.chunks if c.samples):
                sched.append(chunk.seq, fake_token(chunk.seq))
                if chunk.seq.num_generated == chunk.seq.max_tokens:
                    sched.finish(chunk.seq)
    assert a.status is Status.FINISHED  # b came back only when a left
    # its head blocks survived in the cache (a evicted the tail first); the rest is recomputed,
    # generated tokens included, and the chunk samples the token after the last one it had
    assert (resumed.start, resumed.length, resumed.samples) == (4, 3, True)
    assert b.cached == 4
    sched.after_step(plan)
    sched.append(b, fake_token(b))
    run_all(sched)
    assert a.output == expected_output(a) and b.output == expected_output(b)


def test_a_sequence_alone_that_cannot_grow_waits():
    pool = BlockPool(3, 2)  # 2 usable blocks
    sched = Scheduler(pool, max_step_tokens=8)
    a = make_seq("a", 3, 1)
    sched.add(a)
    step(sched)
    assert a.status is Status.FINISHED
    # a sequence that would need three blocks at its peak is refused up front
    assert not sched.fits_ever(5) and sched.fits_ever(4)
    with pytest.raises(ValueError):
        sched.add(make_seq("too-long", 3, 2))


# ---- abort, finish


def test_abort_frees_blocks_at_once():
    pool = BlockPool(20, 4)
    sched = Scheduler(pool, max_step_tokens=8)
    a, b = make_seq("a", 6, 5), make_seq("b", 30, 5)
    sched.add(a)
    sched.add(b)
    step(sched)  # a whole, b a chunk
    assert a.status is b.status is Status.RUNNING
    assert sched.abort("b") is b
    assert b.status is Status.FINISHED and b.blocks == []
    check_invariants(sched)
    assert pool.stats()["used"] == len(a.blocks)
    c = make_seq("c", 4, 1)
    sched.add(c)
    assert sched.abort("c") is c and not sched.waiting
    assert sched.abort("nobody") is None
    sched.finish(a)
    assert pool.stats()["used"] == 0 and not sched.has_work
    assert sched.schedule().is_empty


def test_finished_during_the_step_is_not_committed():
    pool = BlockPool(20, 4)
    sched = Scheduler(pool, max_step_tokens=16)
    a = make_seq("a", 8, 5)
    sched.add(a)
    plan = sched.schedule()
    sched.abort("a")  # e.g. the client went away while the ranks ran
    sched.after_step(plan)
    assert a.computed == 0 and pool.stats()["used"] == 0 and pool.stats()["cached"] == 0


def test_duplicate_and_stale_sequences_refused():
    sched = Scheduler(BlockPool(20, 4))
    a = make_seq("a", 4, 1)
    sched.add(a)
    with pytest.raises(ValueError):
        sched.add(make_seq("a", 4, 1))
    run_all(sched)
    with pytest.raises(ValueError):
        sched.add(a)  # finished, not fresh
    with pytest.raises(ValueError):
        sched.finish(a)
    with pytest.raises(ValueError):
        sched.add(Sequence(id="empty", tokens=[], prompt_len=0, max_tokens=1))
    with pytest.raises(ValueError):
        sched.add(make_seq("nothing-to-generate", 4, 0))


def test_everything_given_back_when_all_finish():
    pool = BlockPool(30, 4)
    sched = Scheduler(pool, max_step_tokens=32)
    for i in range(5):
        sched.add(make_seq(f"s{i}", 9, 4, first=100 * i))
    run_all(sched)
    s = pool.stats()
    assert s["used"] == 0 and s["cached"] + s["free"] == s["total"]


# ---- prefix cache


def test_a_shared_prefix_is_computed_once():
    pool = BlockPool(50, 4)
    sched = Scheduler(pool, max_step_tokens=64)
    system = list(range(500, 532))  # 8 full blocks
    a = Sequence("a", system + [1, 2, 3], 35, 2)
    sched.add(a)
    run_all(sched)
    b = Sequence("b", system + [7, 8], 34, 2)
    sched.add(b)
    plan = step(sched)
    assert [(c.start, c.length) for c in plan.chunks] == [(32, 2)]
    assert b.cached == 32
    run_all(sched)
    assert b.output == expected_output(b)
    s = pool.stats()
    assert s["prefix_hits"] == 32 and s["prefix_queries"] == 35 + 34


def test_a_running_sequence_shares_its_prefix_with_a_newcomer():
    pool = BlockPool(50, 4)
    sched = Scheduler(pool, max_step_tokens=64)
    a = make_seq("a", 17, 10)
    sched.add(a)
    step(sched)
    b = Sequence("b", a.tokens[:17], 17, 3)  # the same prompt while a still runs
    sched.add(b)
    plan = step(sched)
    b_chunk = next(c for c in plan.chunks if c.seq is b)
    assert (b_chunk.start, b_chunk.length) == (16, 1)
    assert b.blocks[:4] == a.blocks[:4] and all(pool.refs(x) == 2 for x in a.blocks[:4])


def test_finishing_a_sharer_leaves_the_owner_its_blocks():
    pool = BlockPool(50, 4)
    sched = Scheduler(pool, max_step_tokens=64)
    a = make_seq("a", 17, 10)
    sched.add(a)
    step(sched)
    used_before = pool.stats()["used"]
    b = Sequence("b", a.tokens[:17], 17, 3)
    sched.add(b)
    step(sched)
    assert pool.stats()["used"] == used_before + len(b.blocks) - 4  # 4 blocks shared
    sched.finish(b)
    assert pool.stats()["used"] == used_before
    assert all(pool.refs(x) == 1 for x in a.blocks)
    check_invariants(sched)


def test_generated_tokens_are_cached_too():
    pool = BlockPool(50, 4)
    sched = Scheduler(pool, max_step_tokens=64)
    a = make_seq("a", 6, 7)
    sched.add(a)
    run_all(sched)
    assert a.computed == 0 and len(a.tokens) == 13  # 12 computed: the last sampled token never was
    # a follow-up turn: the whole previous exchange as its prompt
    b = Sequence("b", list(a.tokens) + [9], len(a.tokens) + 1, 1)
    sched.add(b)
    plan = step(sched)
    assert plan.chunks[0].start == 12  # 3 full blocks: 6 prompt tokens and 6 generated


def test_prefix_caching_off_computes_everything():
    pool = BlockPool(50, 4, prefix_caching=False)
    sched = Scheduler(pool, max_step_tokens=64)
    sched.add(make_seq("a", 20, 1))
    run_all(sched)
    b = make_seq("b", 20, 1)
    sched.add(b)
    assert step(sched).chunks[0].start == 0 and b.cached == 0


def test_salted_sequences_do_not_share():
    pool = BlockPool(50, 4)
    sched = Scheduler(pool, max_step_tokens=64)
    a = make_seq("a", 20, 1)
    sched.add(a)
    run_all(sched)
    b = make_seq("b", 20, 1)
    b.cache_salt = "steer:v1"
    sched.add(b)
    assert step(sched).chunks[0].start == 0


def test_a_blocked_head_is_not_counted_twice_in_stats():
    pool = BlockPool(5, 4)  # 4 usable blocks
    sched = Scheduler(pool, max_step_tokens=64)
    a, b = make_seq("a", 8, 5), make_seq("b", 10, 1, first=50)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        step(sched)
    assert b.status is Status.WAITING
    assert pool.stats()["prefix_queries"] == 8


# ---- sliding window


def test_sliding_window_bounds_the_blocks_of_a_long_generation():
    bs, window = 4, 16
    pool = BlockPool(40, bs)
    sched = Scheduler(pool, max_step_tokens=32, window=window)
    seq = make_seq("long", 10, 300)
    sched.add(seq)
    most = 0
    while sched.has_work:
        step(sched)
        most = max(most, pool.stats()["used"])
        if seq.status is Status.RUNNING:
            live = [b for b in seq.blocks if b != NULL_BLOCK]
            assert len(live) <= window // bs + 2
    assert most <= sched.blocks_at_peak(310) < 310 // bs
    assert seq.output == expected_output(seq)
    assert pool.stats()["used"] == 0


def test_sliding_window_lets_a_long_sequence_fit_a_small_pool():
    pool = BlockPool(12, 4)  # 11 usable blocks: 44 tokens, far less than 10 + 200
    sched = Scheduler(pool, max_step_tokens=8, window=16)
    assert sched.fits_ever(210)
    assert not Scheduler(pool, max_step_tokens=8).fits_ever(210)
    a, b = make_seq("a", 10, 200), make_seq("b", 10, 200, first=50)
    sched.add(a)
    sched.add(b)
    done, _ = run_all(sched)
    assert {s.id for s in done} == {"a", "b"}
    assert a.output == expected_output(a) and b.output == expected_output(b)


# ---- everything at once


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_the_books_and_finish(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    window = rng.choice([None, rng.randint(1, 40)])
    budget = rng.randint(4, 48)
    pool = BlockPool(rng.randint(4, 60), bs, prefix_caching=rng.random() < 0.8)
    sched = Scheduler(
        pool,
        max_step_tokens=budget,
        max_running=rng.randint(1, 12),
        window=window,
        max_prefill_chunk=rng.choice([None, rng.randint(1, budget)]),
    )
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    pending, added, aborted = [], [], set()
    for i in range(rng.randint(5, 25)):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        seq = Sequence(
            f"r{i}",
            prompt,
            len(prompt),
            rng.randint(1, 30),
            cache_salt=rng.choice(["", "", "lora"]),
        )
        if sched.fits_ever(len(prompt) + seq.max_tokens):
            pending.append(seq)
    steps = 0
    done: list[Sequence] = []
    while pending or sched.has_work:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                seq = pending.pop(0)
                sched.add(seq)
                added.append(seq)
        if sched.has_work and rng.random() < 0.02:
            victim = rng.choice(sched.running + sched.waiting)
            assert sched.abort(victim.id) is victim
            aborted.add(victim.id)
            check_invariants(sched)
        if sched.has_work:
            plan = step(sched, done)
            assert not plan.is_empty
        steps += 1
        assert steps < 20_000
    assert {s.id for s in done} | aborted == {s.id for s in added}
    for seq in added:
        assert seq.status is Status.FINISHED and seq.blocks == []
        if seq.id not in aborted:
            assert seq.output == expected_output(seq)
    s = pool.stats()
    assert s["used"] == 0 and s["cached"] + s["free"] == s["total"]
    assert len(pool._block_of) <= pool.num_blocks - 1


def test_micro_batches_take_disjoint_shares_and_never_preempt_a_step_in_flight():
    """Two steps in flight (pipeline stages): each takes half the sequences, the second none of the
    first's; when blocks run out, only a sequence outside every step in flight is preempted."""
    sched = Scheduler(BlockPool(num_blocks=40, block_size=4), max_step_tokens=64, max_running=8)
    seqs = [make_seq(f"s{i}", 6, 5) for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule(parts=2)
    busy = frozenset(c.seq.id for c in first.chunks)
    second = sched.schedule(busy, parts=2)
    assert len(first.chunks) == len(second.chunks) == 3
    assert busy.isdisjoint(c.seq.id for c in second.chunks)
    assert sched.schedule(busy | {c.seq.id for c in second.chunks}, parts=2).is_empty
    for plan in (first, second):
        sched.after_step(plan)
        for chunk in plan.chunks:
            sched.append(chunk.seq, fake_token(chunk.seq))
    check_invariants(sched)
    # a pool too small for everyone: the sequences in flight keep their blocks
    tight = Scheduler(BlockPool(num_blocks=7, block_size=4), max_step_tokens=64, max_running=8)
    a, b, c = make_seq("a", 8, 9), make_seq("b", 8, 9), make_seq("c", 7, 9)
    for seq in (a, b, c):
        tight.add(seq)
    plan = tight.schedule()
    assert [ch.seq.id for ch in plan.chunks] == ["a", "b", "c"]
    tight.after_step(plan)
    for seq in (a, b, c):
        tight.append(seq, fake_token(seq))
    # c's step is in flight; a needs a block for its next position: the victim is b, the last one
    # not in
    # flight, though c comes last
    plan = tight.schedule(frozenset({"c"}))
    assert (
        [s.id for s in plan.preempted] == ["b"]
        and c.status is Status.RUNNING
        and b.status is Status.WAITING
    )
    assert [ch.seq.id for ch in plan.chunks] == ["a"]
    check_invariants(tight)
