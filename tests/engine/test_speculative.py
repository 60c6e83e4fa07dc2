"""MTP speculative decoding in the token engine (engine/drafter.py, engine/rejection.py) on a tiny
DeepSeek-V3 with one MTP layer, made here from the tiny path as published checkpoints store it:
greedy output with drafts equals greedy output without them, token for token, for prompts of mixed
length batched together (TP=2 and EP=2 in tests/engine/test_speculative_ranks.py); the draft
counters add up; an MTP layer built to echo its input token gets drafts accepted where the model
repeats itself; requests that never draft, steered and adapted ones, preemption under a tiny block
budget, an FP8 checkpoint in both weight modes; `ster generate --speculative mtp` answers as
`ster generate`; and where drafting cannot work it is refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.config.load import model_config
from ster_dist.engine.loop import EngineConfig, TokenEngine, check_speculative
from ster_dist.engine.sampling import SamplingParams
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.group import LocalGroup
from tests.cli_run import cli_generate
from tests.engine.test_engine import alone, open_engine, prompts
from tests.load.test_fp8 import BLOCKS, mtp_tensors, write_fp8
from tests.tiny_models import make_tiny

LENGTHS = [6, 3, 9, 4, 12]


def with_mtp(directory: Path, echo: bool = False, family: str = "deepseek_v3") -> Path:
    """A tiny checkpoint of `family` (one that stores its MTP layer as DeepSeek-V3 does) with one
    MTP layer after its decoder's (tests/load/test_fp8.py's: a copy of its last layer, random), or
    one whose MTP layer echoes the token it reads: eh_proj passes the normed embedding alone, the
    layer's attention and feed-forward add nothing (their output projections zero), and its head is
    the embedding, so the draft is the last token again, right wherever the model repeats a
    token."""
    make_tiny(family, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    config["num_nextn_predict_layers"] = 1
    mtp = mtp_tensors(tensors, layers, hidden, config["vocab_size"])
    if echo:
        prefix = f"model.layers.{layers}."
        for name in mtp:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                mtp[name] = torch.zeros_like(mtp[name])
        mtp[prefix + "eh_proj.weight"] = torch.cat(
            (torch.eye(hidden), torch.zeros(hidden, hidden)), 1
        )
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            mtp[prefix + norm + ".weight"] = torch.ones(hidden)
        mtp[prefix + "shared_head.head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors.update(mtp)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return with_mtp(tmp_path_factory.mktemp("deepseek_mtp"))


@pytest.fixture(scope="module")
def reference(deepseek):
    """Each request alone on one rank with the static cache, no drafts: what its row of a batch must
    equal."""
    single = load_model(resolve(str(deepseek)), "f32")
    return [alone(single.model, p, n) for p, n in zip(prompts(5, seed=3), LENGTHS)]


def run(
    directory, drafts: int, group=None, loaded: bool = False, **params
) -> tuple[list[list[int]], dict]:
    """The five prompts batched through one engine; `loaded`: the group holds the model already."""
    engine = (
        engine_on(directory, group, max_step_tokens=48, speculative_tokens=drafts)
        if loaded
        else open_engine(directory, group=group, max_step_tokens=48, speculative_tokens=drafts)
    )
    with engine:
        streams = [
            engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True, **params))
            for p, n in zip(prompts(5, seed=3), LENGTHS)
        ]
        return [s.result().token_ids for s in streams], engine.stats()


def engine_on(directory, group, **config) -> TokenEngine:
    cfg = model_config(resolve(str(directory)))
    return TokenEngine(
        group,
        cfg,
        Tokenizer.from_directory(directory),
        cfg.eos_token_ids or (2,),
        EngineConfig(**{"kv_cache_memory": 4 << 20, "block_size": 4, **config}),
    )


def counted(stats: dict) -> None:
    assert stats["drafted_tokens"] > 0
    assert stats["accepted_tokens"] + stats["rejected_tokens"] == stats["drafted_tokens"]


def drafts_keep_greedy(directory, drafts: int, accepted: bool) -> None:
    """Greedy output with `drafts` per decode equals it without, every draft counted; `accepted`:
    some were accepted (an echoing MTP layer)."""
    plain, _ = run(directory, 0)
    got, stats = run(directory, drafts)
    assert got == plain
    counted(stats)
    if accepted:
        assert stats["accepted_tokens"] > 0


@pytest.mark.parametrize("drafts", [1, 3])
def test_greedy_with_drafts_equals_greedy_without(deepseek, reference, drafts):
    got, stats = run(deepseek, drafts)
    assert got == reference
    counted(stats)


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    return with_mtp(tmp_path_factory.mktemp("deepseek_echo"), echo=True)


def test_an_echoing_mtp_layer_gets_drafts_accepted(echo):
    plain, plain_stats = run(echo, 0)
    got, stats = run(echo, 2)
    assert got == plain
    counted(stats)
    assert stats["accepted_tokens"] > 0 and stats["acceptance_rate"] > 0
    # every accepted draft is a token no step of its own had to decode
    assert stats["steps"] < plain_stats["steps"]


def test_rejection_sampling_at_a_near_zero_temperature_draws_the_greedy_tokens(echo):
    """The sampled path (engine/rejection.py through the engine) with drafts both kept and refused:
    a distribution all but one-hot keeps exactly the drafts greedy keeps and draws greedy's token
    after them."""
    plain, _ = run(echo, 0)
    got, stats = run(echo, 2, temperature=1e-4, seed=3)
    assert got == plain
    counted(stats)
    assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"]


def test_requests_that_never_draft_share_the_batch(deepseek, reference):
    """Requests asking for logprobs or penalties decode one token a step beside drafting ones, all
    greedy's."""
    asks = [
        {"logprobs": 1},
        {},
        {"repetition_penalty": 1.0, "logits_of": (5,)},
        {},
        {"logprobs": 0},
    ]
    with open_engine(deepseek, max_step_tokens=48, speculative_tokens=2) as engine:
        streams = [
            engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True, **a))
            for p, n, a in zip(prompts(5, seed=3), LENGTHS, asks)
        ]
        results = [s.result() for s in streams]
        stats = engine.stats()
    assert [r.token_ids for r in results] == reference
    assert len(results[0].logprobs) == LENGTHS[0]
    counted(stats)


def test_steered_and_adapted_requests_with_drafts_equal_them_without(deepseek):
    """A steering vector and an adapter reach a decode's drafted rows as they reach its own
    token."""
    from tests.engine.test_engine import random_sites

    single = load_model(resolve(str(deepseek)), "f32")
    g = torch.Generator().manual_seed(29)
    vector = [(1, torch.randn(single.cfg.hidden_size, generator=g))]
    sites = random_sites(single.model, ("q_b", "o"), g, 1.0)
    modifiers = [{}, {"steering": ("v", 2.0)}, {}, {"adapter": "x"}, {"steering": ("v", -1.0)}]

    def tokens(drafts: int) -> list[list[int]]:
        with open_engine(deepseek, max_step_tokens=48, speculative_tokens=drafts) as engine:
            engine.add_vector("v", vector)
            engine.add_adapter("x", sites)
            streams = [
                engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True), **m)
                for p, n, m in zip(prompts(5, seed=3), LENGTHS, modifiers)
            ]
            return [s.result().token_ids for s in streams]

    assert tokens(2) == tokens(0)


def test_preemption_with_drafts_gives_the_same_tokens(deepseek):
    """Under a tiny block budget sequences are preempted and recomputed, their waiting MTP rows then
    stale."""
    ps = prompts(6, seed=7, lo=8, hi=16)

    def tokens(drafts: int) -> tuple[list[list[int]], dict]:
        with open_engine(
            deepseek, max_blocks=16, prefix_caching=False, speculative_tokens=drafts
        ) as engine:
            streams = [engine.submit(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in ps]
            return [s.result().token_ids for s in streams], engine.stats()

    got, stats = tokens(2)
    assert stats["preemptions"] > 0
    assert got == tokens(0)[0]
    counted(stats)


def test_a_seeded_sampled_request_with_drafts_repeats_and_counts(deepseek):
    first, stats = run(deepseek, 2, temperature=0.8, seed=11)
    again, _ = run(deepseek, 2, temperature=0.8, seed=11)
    assert first == again and [len(t) for t in first] == LENGTHS
    counted(stats)


@pytest.mark.parametrize("weights", ["dequantize", "fp8"])
def test_an_fp8_checkpoints_mtp_layer_drafts_in_both_weight_modes(tmp_path, weights):
    """DeepSeek-V3 as published in FP8 (tests/load/test_fp8.py's block scheme, the MTP layer's
    projections, eh_proj among them, quantized): the layer loads dequantized or kept FP8 and greedy
    output is unchanged."""
    source = with_mtp(tmp_path / "source")
    write_fp8(
        load_file(str(source / "model.safetensors")),
        BLOCKS["deepseek_v3"],
        source,
        tmp_path / "fp8",
        tmp_path / "ref",
        json.loads((source / "config.json").read_text()),
    )
    outputs = []
    for drafts in (0, 2):
        group = LocalGroup()
        try:
            group.call("load", resolve(str(tmp_path / "fp8")), "f32", "cpu", weights)
            got, stats = run(tmp_path / "fp8", drafts, group=group, loaded=True)
        finally:
            group.close()
        outputs.append(got)
    assert outputs[0] == outputs[1]
    counted(stats)


def test_ster_generate_with_mtp_answers_as_without(deepseek):
    args = (
        f"--model={deepseek}",
        "--prompt=hello there",
        "--chat-template=off",
        "--max-new-tokens=8",
        "--ignore-eos",
    )
    assert (
        cli_generate(*args, "--speculative=mtp", "--num-speculative-tokens=2")["text"]
        == cli_generate(*args)["text"]
    )


def test_speculation_is_refused_without_mtp_layers(tmp_path):
    make_tiny("llama", tmp_path)
    with pytest.raises(Refusal, match="num_nextn_predict_layers"):
        open_engine(tmp_path, speculative_tokens=1)


def test_speculation_is_refused_for_recurrent_state_a_pipeline_and_two_mtp_layers(
    deepseek, tmp_path
):
    make_tiny("mamba", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(Refusal, match="recurrent layers"):
        open_engine(tmp_path, speculative_tokens=1)
    cfg = model_config(resolve(str(deepseek)))
    with pytest.raises(Refusal, match="--pp"):
        check_speculative(cfg, EngineConfig(speculative_tokens=1, micro_batches=2))
    with pytest.raises(Refusal, match="exactly one MTP layer"):
        check_speculative(
            dataclasses.replace(cfg, mtp_layers=2), EngineConfig(speculative_tokens=1)
        )


def test_draft_count_is_refused_without_speculative(deepseek):
    with pytest.raises(Refusal, match="--speculative mtp"):
        cli_generate(f"--model={deepseek}", "--prompt=hi", "--num-speculative-tokens=2")
