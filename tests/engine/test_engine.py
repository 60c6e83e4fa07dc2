"""The token-level engine end to end on real tiny checkpoints: continuous batching equals
one-at-a-time greedy decoding by whole re-reads (TP=1, TP=2 on a gloo group, EP=2 on a MoE),
prefix caching, preemption, cancellation, per-request steering, adapters and seeds."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ster_dist.engine.loop import TokenEngine
from ster_dist.engine.sampling import SamplingParams
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.resolve import resolve
from ster_dist.steer.attach import add_steering
from ster_dist.workers.group import LocalGroup
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import alone, group_cfg, open_engine
from tests.tiny_models import make_tiny


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny("llama", directory)
    return directory


@pytest.fixture(scope="module")
def reference(llama):
    """The same checkpoint on one rank, read whole at every token (engine_checks.alone): what each
    request alone must equal."""
    return load_model(resolve(str(llama)), "f32")


def prompts(count: int, seed: int = 0, lo: int = 2, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (count,), generator=g).tolist()
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def random_sites(
    model, projections: tuple[str, ...], g: torch.Generator, scale: float
) -> list[dict]:
    """A random rank-4 adapter on every layer's attention `projections`, global factors as the
    engine takes them."""
    params = dict(model.named_parameters())
    sites = []
    for layer in range(model.cfg.num_layers):
        for proj in projections:
            out_features, in_features = params[f"layers.{layer}.attn.{proj}.weight"].shape
            sites.append(
                {
                    "param": f"layers.{layer}.attn.{proj}.weight",
                    "a": torch.randn(4, in_features, generator=g) * 0.3,
                    "b": torch.randn(out_features, 4, generator=g) * 0.3,
                    "scale": scale,
                }
            )
    return sites


def run_all(engine: TokenEngine, requests, **submit) -> list[list[int]]:
    streams = [engine.submit(p, params, **submit) for p, params in requests]
    return [s.result().token_ids for s in streams]


def test_continuous_batching_equals_one_at_a_time_greedy(llama, reference):
    ps = prompts(9)
    lengths = [3, 8, 12, 5, 9, 1, 7, 12, 4]
    with open_engine(llama, max_step_tokens=24) as engine:
        collected = {}

        def consume(i, stream):
            collected[i] = [t for d in stream for t in d.token_ids]

        threads = []
        for wave in range(3):  # requests arrive while others are mid-generation
            for i in range(wave * 3, wave * 3 + 3):
                stream = engine.submit(
                    ps[i], SamplingParams(max_tokens=lengths[i], ignore_eos=True)
                )
                threads.append(threading.Thread(target=consume, args=(i, stream)))
                threads[-1].start()
            while engine.stats()["steps"] < 2 * (wave + 1):
                time.sleep(0.005)
        for t in threads:
            t.join(60)
        stats = engine.stats()
    for i, p in enumerate(ps):
        assert collected[i] == alone(reference.model, p, lengths[i]), i
    assert stats["steps"] < sum(lengths)  # requests shared steps
    assert stats["kv_blocks"]["used"] == 0  # every finished request freed its blocks


def test_paged_step_equals_whole_reads_with_eos(llama, reference):
    eos = tuple(reference.cfg.eos_token_ids or (2,))
    ps = prompts(6, seed=3)
    with open_engine(llama) as engine:
        got = run_all(engine, [(p, SamplingParams(max_tokens=12)) for p in ps])
    for p, tokens in zip(ps, got):
        assert tokens == alone(reference.model, p, 12, eos)


def test_prefix_cached_request_equals_cold_and_counts_the_hit(llama, reference):
    shared = prompts(1, seed=5, lo=21, hi=22)[0]
    first, second = shared + [7, 8, 9], shared + [11, 12]
    with open_engine(llama) as engine:
        cold = run_all(engine, [(first, SamplingParams(max_tokens=6))])[0]
        before = engine.stats()["kv_blocks"]
        stream = engine.submit(second, SamplingParams(max_tokens=6))
        warm = stream.result()
        after = engine.stats()["kv_blocks"]
    assert cold == alone(reference.model, first, 6, (2,))
    assert warm.token_ids == alone(reference.model, second, 6, (2,))
    assert warm.cached_tokens == 20  # five whole 4-token blocks of the shared 21 tokens
    assert after["prefix_hits"] - before["prefix_hits"] == 20


def test_logits_of_reports_the_raw_logits_at_each_sampled_position(llama, reference):
    """A request asking logits_of gets those ids' logits, unchanged by its sampling, at every
    sampled position; a request beside it that asks nothing gets none (and its step result carries
    none)."""
    prompt, ids = prompts(1, seed=7, lo=9, hi=10)[0], (5, 0, 250, 5)
    with open_engine(llama) as engine:
        scored = engine.submit(
            prompt,
            SamplingParams(
                max_tokens=3, temperature=2.0, seed=1, repetition_penalty=1.5, logits_of=ids
            ),
        )
        plain = engine.submit(prompt, SamplingParams(max_tokens=3))
        got, other = scored.result(), plain.result()
        with pytest.raises(Refusal, match="past this model's"):
            engine.submit(prompt, SamplingParams(logits_of=(engine.cfg.vocab_size,)))
    assert other.scores == [] and len(got.scores) == 3
    with torch.no_grad():
        tokens = torch.tensor([prompt + got.token_ids])
        logits = reference.model(tokens)[0].double()
    for step, scores in enumerate(got.scores):
        want = logits[len(prompt) - 1 + step, list(ids)].tolist()
        assert scores == pytest.approx(want, abs=1e-4)


def test_preemption_under_a_tiny_block_budget_gives_the_same_tokens(llama, reference):
    ps = prompts(6, seed=7, lo=8, hi=16)
    with open_engine(llama, max_blocks=16, prefix_caching=False) as engine:
        got = run_all(engine, [(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in ps])
        stats = engine.stats()
    assert stats["preemptions"] > 0
    for p, tokens in zip(ps, got):
        assert tokens == alone(reference.model, p, 20)


def test_cancel_frees_blocks_at_once(llama):
    with open_engine(llama) as engine:
        stream = engine.submit(prompts(1)[0], SamplingParams(max_tokens=100, ignore_eos=True))
        next(stream)
        assert engine.stats()["kv_blocks"]["used"] > 0
        stream.cancel()
        deltas = list(stream)
        assert deltas[-1].finish_reason == "abort"
        assert engine.stats()["kv_blocks"]["used"] == 0


def test_seeded_sampling_is_the_same_alone_or_batched(llama):
    ps = prompts(5, seed=11)
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(5)
    ]
    with open_engine(llama) as engine:
        batched = run_all(engine, list(zip(ps, params)))
        single = [run_all(engine, [(p, q)])[0] for p, q in zip(ps, params)]
    assert batched == single
    assert len({tuple(t) for t in batched}) > 1


def test_per_request_steering_in_one_batch_equals_each_alone(llama, reference):
    hidden, layers = reference.cfg.hidden_size, reference.cfg.num_layers
    g = torch.Generator().manual_seed(1)
    vectors = {
        "a": [(1, torch.randn(hidden, generator=g))],
        "b": [(0, torch.randn(hidden, generator=g)), (2, torch.randn(hidden, generator=g))],
    }
    ps = prompts(3, seed=13)
    plan = [("a", 2.0), None, ("b", -1.5)]
    with open_engine(llama) as engine:
        for key, vecs in vectors.items():
            engine.add_vector(key, vecs)
        streams = [
            engine.submit(p, SamplingParams(max_tokens=8, ignore_eos=True), steering=s)
            for p, s in zip(ps, plan)
        ]
        got = [s.result().token_ids for s in streams]
    for p, s, tokens in zip(ps, plan, got):
        removers = add_steering(reference.model, vectors[s[0]], s[1]) if s else []
        try:
            assert tokens == alone(reference.model, p, 8)
        finally:
            for remove in removers:
                remove()
    assert layers == 3


def test_per_request_adapters_in_one_batch_equal_each_alone(llama, reference):
    from ster_dist.adapters.attach import attach

    g = torch.Generator().manual_seed(2)
    adapters = {
        "x": random_sites(reference.model, ("q", "v"), g, 1.0),
        "y": random_sites(reference.model, ("q", "v"), g, 2.0),
    }
    ps = prompts(3, seed=17)
    plan = ["x", None, "y"]
    with open_engine(llama) as engine:
        for name, s in adapters.items():
            engine.add_adapter(name, s)
        streams = [
            engine.submit(p, SamplingParams(max_tokens=8, ignore_eos=True), adapter=a)
            for p, a in zip(ps, plan)
        ]
        got = [s.result().token_ids for s in streams]
    for p, a, tokens in zip(ps, plan, got):
        detach = attach(reference.model, adapters[a]) if a else (lambda: None)
        try:
            assert tokens == alone(reference.model, p, 8)
        finally:
            detach()


def test_refusals_before_queueing(llama):
    with open_engine(llama) as engine:
        with pytest.raises(Refusal, match="no tokens"):
            engine.submit([], SamplingParams())
        with pytest.raises(Refusal, match="positions"):
            engine.submit([5] * 100, SamplingParams(max_tokens=100))
        with pytest.raises(Refusal, match="not registered"):
            engine.submit([5, 6], SamplingParams(), steering=("nope", 1.0))


def test_a_stream_reads_with_async_for(llama, reference):
    import asyncio

    prompt = prompts(1, seed=23)[0]

    async def read(engine):
        texts, ids = [], []
        async for delta in engine.submit(prompt, SamplingParams(max_tokens=7, ignore_eos=True)):
            texts.append(delta.text)
            ids += delta.token_ids
        return ids

    with open_engine(llama) as engine:
        ids = asyncio.run(read(engine))
    assert ids == alone(reference.model, prompt, 7)


@pytest.mark.parametrize("variant, tp, ep", [("llama", 2, 1), ("qwen3_moe", 1, 2)])
def test_continuous_batching_across_ranks_equals_one_rank(tmp_path, variant, tp, ep):
    """Every request alone on one rank, read whole per token, equals its row of one batch across
    ranks: plain, steered, and with an adapter on the attention projections (cut per rank as the
    loader cuts)."""
    from ster_dist.adapters.attach import attach

    make_tiny(variant, tmp_path)
    single = load_model(resolve(str(tmp_path)), "f32")
    hidden = single.cfg.hidden_size
    g = torch.Generator().manual_seed(29)
    vector = [(1, torch.randn(hidden, generator=g))]
    sites = random_sites(single.model, ("q", "v", "o"), g, 1.0)
    ps = prompts(5, seed=19)
    lengths = [6, 3, 9, 4, 7]
    modifiers = [{}, {"steering": ("v", 2.0)}, {}, {"adapter": "x"}, {}]
    with SpawnGroup(tp * ep, ep=ep) as group:
        with open_engine(tmp_path, group=group, max_step_tokens=20) as engine:
            engine.add_vector("v", vector)
            engine.add_adapter("x", sites)
            streams = [
                engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True), **m)
                for p, n, m in zip(ps, lengths, modifiers)
            ]
            got = [s.result().token_ids for s in streams]
    for p, n, m, tokens in zip(ps, lengths, modifiers, got):
        undo = [attach(single.model, sites)] if "adapter" in m else []
        undo += add_steering(single.model, vector, 2.0) if "steering" in m else []
        try:
            assert tokens == alone(single.model, p, n)
        finally:
            for remove in undo:
                remove()


def test_a_reused_request_id_is_refused_alone(llama, reference):
    with open_engine(llama) as engine:
        first = engine.submit(
            [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True), request_id="same"
        )
        second = engine.submit([8, 9], SamplingParams(max_tokens=3), request_id="same")
        with pytest.raises(Refusal, match="request same"):
            second.result()
        assert first.result().token_ids == alone(reference.model, [5, 6, 7], 30)
        assert engine.submit([8, 9], SamplingParams(max_tokens=3)).result().token_ids == alone(
            reference.model, [8, 9], 3, (2,)
        )


def test_a_session_replaces_an_engine_a_failed_step_stopped(llama):
    from ster_dist.engine.client import RunnerClient
    from ster_dist.schema.common import Runtime
    from ster_dist.session import Session

    with Session(Runtime(model=str(llama))) as session:
        engine = session.engine(4 << 20)
        RunnerClient(session.group).stop()  # the ranks lose their cache under the running engine
        with pytest.raises(Refusal, match="before start"):
            engine.submit([5, 6], SamplingParams(max_tokens=2)).result()
        assert engine.stopped
        with pytest.raises(Refusal, match="engine has stopped"):
            engine.submit([5, 6], SamplingParams(max_tokens=2))
        fresh = session.engine(4 << 20)
        assert (
            fresh is not engine
            and len(fresh.submit([5, 6], SamplingParams(max_tokens=2)).result().token_ids) == 2
        )
