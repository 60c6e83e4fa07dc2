"""Pipeline parallelism on real gloo process groups: --pp 2 alone, TP2 x PP2 and PP2 x EP2 on four
ranks equal one rank and Transformers (logits and greedy tokens); each stage reads only its layers'
tensors; capture and steering reach layers on either stage; the stage split balances parameter
bytes; families whose layers cannot be cut are refused before any weight is read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ster_dist.engine.modifiers import StandingModifiers
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parallel.pipeline import check_pipeline, stage_bounds
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.steer.attach import add_steering
from ster_dist.steer.capture import capture, read_hidden
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import alone, engine_tokens
from tests.tiny_models import make_tiny


def _brute_force(sizes, first, last, pp):
    """The smallest largest-stage cost over every way to cut the layers into pp contiguous
    stages."""
    from itertools import combinations

    n, best = len(sizes), None
    for cuts in combinations(range(1, n), pp - 1):
        bounds = list(zip((0, *cuts), (*cuts, n)))
        costs = [
            sum(sizes[a:b]) + (first if s == 0 else 0) + (last if s == pp - 1 else 0)
            for s, (a, b) in enumerate(bounds)
        ]
        best = max(costs) if best is None else min(best, max(costs))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_stage_bounds_are_contiguous_and_as_balanced_as_a_brute_force_search(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 9, (1,), generator=g))
    pp = int(torch.randint(2, min(n, 4) + 1, (1,), generator=g))
    sizes = torch.randint(1, 100, (n,), generator=g).tolist()
    first, last = (int(v) for v in torch.randint(0, 150, (2,), generator=g))
    bounds = stage_bounds(sizes, first, last, pp)
    assert bounds[0][0] == 0 and bounds[-1][1] == n and len(bounds) == pp
    assert all(a < b for a, b in bounds) and all(
        bounds[s][1] == bounds[s + 1][0] for s in range(pp - 1)
    )
    costs = [
        sum(sizes[a:b]) + (first if s == 0 else 0) + (last if s == pp - 1 else 0)
        for s, (a, b) in enumerate(bounds)
    ]
    assert max(costs) == _brute_force(sizes, first, last, pp)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tied head (Qwen3 tiny): the last stage must hold the embedding as its head."""
    directory = tmp_path_factory.mktemp("qwen3")
    reference = make_tiny("qwen3", directory)
    return resolve(str(directory)), reference


@pytest.fixture(scope="module")
def pp2():
    with SpawnGroup(2, pp=2) as group:
        yield group


def _ids(seed=0):
    return torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_pp2_equals_one_rank_and_transformers_on_a_tied_head(pp2, qwen3):
    checkpoint, reference = qwen3
    single = load_model(checkpoint, "f32")
    loads = pp2.call("load", checkpoint, "f32", "cpu")
    ids = _ids()
    ours = pp2.call("logits", ids)[pp2.lead]
    with torch.no_grad():
        assert compare(ours, single.model(ids))["max_relative_error"] < 1e-5
        assert compare(ours, reference(ids).logits)["max_relative_error"] < 1e-4
    prompts = [ids[0, :7].tolist(), ids[1, :4].tolist()]
    eos = single.cfg.eos_token_ids
    assert engine_tokens(pp2, prompts, 8, eos, checkpoint) == engine_tokens(single, prompts, 8, eos)
    # each stage read its own layers' tensors, and the two together read the whole checkpoint once
    # (the tied embedding twice: the first stage embeds with it, the last projects with it)
    embedding = single.cfg.vocab_size * single.cfg.hidden_size * 4
    assert sum(load["bytes_read"] for load in loads) == single.bytes_read + embedding
    assert all(load["bytes_read"] < single.bytes_read for load in loads)


def test_capture_and_steering_reach_layers_on_either_stage(pp2, qwen3):
    checkpoint, _ = qwen3
    single = load_model(checkpoint, "f32")
    pp2.call("load", checkpoint, "f32", "cpu")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    layers = list(range(single.cfg.num_layers))
    ((_, ours),) = list(capture(pp2, prompts, layers, "last", 0, 8))
    theirs = read_hidden(single.model, prompts, layers, "last")
    assert sorted(ours) == layers
    for layer in layers:
        assert torch.allclose(ours[layer], theirs[layer], atol=1e-5)
    # steering the last layer of the first stage and of the last: both change the tokens as on one
    # rank
    vectors = [
        (0, torch.randn(single.cfg.hidden_size) * 4),
        (layers[-1], torch.randn(single.cfg.hidden_size) * 4),
    ]
    pp2.on(StandingModifiers).steer("t", vectors, 1.5)
    removers = add_steering(single.model, vectors, 1.5)
    ids = _ids(1)
    steered = pp2.call("logits", ids)[pp2.lead]
    with torch.no_grad():
        assert compare(steered, single.model(ids))["max_relative_error"] < 1e-5
    for remove in removers:
        remove()
    pp2.on(StandingModifiers).detach("t")


@pytest.mark.slow  # four spawned ranks on two cores
@pytest.mark.parametrize("variant, tp, ep", [("llama", 2, 1), ("qwen2_moe", 1, 2)])
def test_four_ranks_tp_or_ep_times_pp2_equal_one_rank_and_transformers(tmp_path, variant, tp, ep):
    reference = make_tiny(variant, tmp_path)
    checkpoint = resolve(str(tmp_path))
    single = load_model(checkpoint, "f32")
    ids = _ids(2)
    with SpawnGroup(4, ep=ep, pp=2) as group:
        group.call("load", checkpoint, "f32", "cpu")
        ours = group.call("logits", ids)[group.lead]
        prompts = [ids[0, :6].tolist(), ids[1, :9].tolist()]
        eos = single.cfg.eos_token_ids
        tokens = engine_tokens(group, prompts, 8, eos, checkpoint)
    with torch.no_grad():
        assert compare(ours, single.model(ids))["max_relative_error"] < 1e-5
        assert compare(ours, reference(ids).logits)["max_relative_error"] < 1e-4
    assert tokens == engine_tokens(single, prompts, 8, eos)


def test_families_whose_layers_cannot_be_cut_are_refused(tmp_path):
    from ster_dist.config.load import model_config

    make_tiny("zamba2", tmp_path)
    cfg = model_config(resolve(str(tmp_path)))
    with pytest.raises(Refusal, match="cannot be split into pipeline stages; use --tp"):
        check_pipeline(cfg, 2)
    with pytest.raises(Refusal, match=f"--pp {cfg.num_layers + 1} is more than the model's"):
        check_pipeline(cfg, cfg.num_layers + 1)
    # shared keys and per-layer inputs read across layers
    make_tiny("gemma4_text", tmp_path / "gemma4")
    gemma4 = model_config(resolve(str(tmp_path / "gemma4")))
    with pytest.raises(
        Refusal, match="gemma4_text reuses earlier layers' keys and values, so its layers cannot"
    ):
        check_pipeline(gemma4, 2)
    # per-layer inputs alone: made from the tokens
    unshared = dataclasses.replace(gemma4, layer_kv_source=())
    with pytest.raises(
        Refusal, match="gemma4_text feeds every layer per-layer inputs made from the tokens, so"
    ):
        check_pipeline(unshared, 2)


def test_the_token_engine_over_two_stages_equals_one_request_at_a_time(pp2, qwen3):
    from ster_dist.config.load import model_config
    from ster_dist.engine.loop import EngineConfig, TokenEngine
    from ster_dist.engine.sampling import SamplingParams
    from ster_dist.tokenizer import Tokenizer

    checkpoint, _ = qwen3
    single = load_model(checkpoint, "f32")
    pp2.call("load", checkpoint, "f32", "cpu")
    cfg = model_config(checkpoint)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 17, 9, 3)]
    lengths = [6, 3, 9, 5]
    for micro_batches in (1, 2):  # two: a step in flight per stage, on disjoint requests
        config = EngineConfig(
            kv_cache_memory=4 << 20, block_size=4, max_step_tokens=16, micro_batches=micro_batches
        )
        with TokenEngine(
            pp2, cfg, Tokenizer.from_directory(checkpoint.directory), (2,), config
        ) as engine:
            streams = [
                engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True))
                for p, n in zip(prompts, lengths)
            ]
            got = [s.result().token_ids for s in streams]
            steps, overlapped = engine.stats()["steps"], engine.stats()["overlapped_steps"]
        assert (overlapped > 0) == (micro_batches > 1)
        for p, n, tokens in zip(prompts, lengths, got):
            assert tokens == alone(single.model, p, n), micro_batches
        assert steps < sum(lengths)  # the requests shared steps
    # what decide reads: the raw logits of chosen ids, from the last stage
    ids = (5, 0, 250)
    with TokenEngine(
        pp2,
        cfg,
        Tokenizer.from_directory(checkpoint.directory),
        (2,),
        EngineConfig(kv_cache_memory=4 << 20, block_size=4, micro_batches=2),
    ) as engine:
        scored = engine.submit(
            prompts[0], SamplingParams(max_tokens=2, ignore_eos=True, logits_of=ids)
        ).result()
    with torch.no_grad():
        logits = single.model(torch.tensor([prompts[0] + scored.token_ids]))[0].double()
    for step, scores in enumerate(scored.scores):
        assert scores == pytest.approx(
            logits[len(prompts[0]) - 1 + step, list(ids)].tolist(), abs=1e-4
        )


def test_an_adapter_on_every_layer_attaches_across_stages(pp2, qwen3):
    from ster_dist.adapters.attach import attach

    checkpoint, _ = qwen3
    single = load_model(checkpoint, "f32")
    pp2.call("load", checkpoint, "f32", "cpu")
    g = torch.Generator().manual_seed(7)
    params = dict(single.model.named_parameters())
    sites = []
    for layer in range(single.cfg.num_layers):
        out_features, in_features = params[f"layers.{layer}.attn.q.weight"].shape
        sites.append(
            {
                "param": f"layers.{layer}.attn.q.weight",
                "a": torch.randn(4, in_features, generator=g) * 0.3,
                "b": torch.randn(out_features, 4, generator=g) * 0.3,
                "scale": 1.0,
            }
        )
    pp2.on(StandingModifiers).adapt("a", sites)
    detach = attach(single.model, sites)
    ids = _ids(3)
    adapted = pp2.call("logits", ids)[pp2.lead]
    with torch.no_grad():
        assert compare(adapted, single.model(ids))["max_relative_error"] < 1e-5
    detach()
    pp2.on(StandingModifiers).detach("a")
