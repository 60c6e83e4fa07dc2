"""Looped models' own checks (ster_dist/model/loop.py, families/looped.py): HRM-Text (hrm_text) under prefix_lm,
against Transformers' HrmTextForCausalLM given the prompt as token_type_ids of ones. A prompt read whole from
position zero attends both ways within itself, in the static cache and in the token engine (which reads each
prompt in one chunk and shares no prefix), later tokens and reads without a cache causally; every pass is its
own layer (cache slots, hook site) over weights held once. The causal parity, cache, batch and TP=2 checks run in
tests/test_parity.py and tests/test_tensor_parallel.py (tests/tiny/looped.py)."""

from __future__ import annotations

import json

import pytest
import torch

from ster_dist.engine.blocks import BlockPool
from ster_dist.engine.sampling import SamplingParams
from ster_dist.engine.scheduler import Scheduler, Sequence
from ster_dist.errors import Refusal
from ster_dist.families.registry import family_table
from ster_dist.generate import Sampling, generate
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.remote_checks import random_ids
from tests.test_recurrent_engine import open_engine, prompts, run_all
from tests.tiny_models import BASE_CONFIG, perturb_norms
from tests.tiny_tokenizer import build_tiny_tokenizer

# two layers a stack, two high cycles of three low passes and one high: 16 passes' layers
HRM = dict(num_hidden_layers=2, head_dim=16, H_cycles=2, L_cycles=3, embedding_scale=7.0, prefix_lm=True)


@pytest.fixture(scope="module")
def hrm(tmp_path_factory):
    """(checkpoint directory, Transformers' model, ours loaded) of a tiny HRM-Text under prefix_lm."""
    import transformers

    directory = tmp_path_factory.mktemp("hrm_text")
    torch.manual_seed(0)
    reference = transformers.HrmTextForCausalLM(transformers.HrmTextConfig(**{**BASE_CONFIG, **HRM})).eval()
    perturb_norms(reference, 0)  # z_L_init starts at zero
    reference.save_pretrained(directory, safe_serialization=True)
    build_tiny_tokenizer(directory)
    return directory, reference, load_model(resolve(str(directory)), "f32")


def _typed(length: int, prompt: int) -> torch.Tensor:
    return (torch.arange(length) < prompt).long().unsqueeze(0)


def test_a_prompt_read_whole_attends_both_ways_then_each_token_causally(hrm):
    _, reference, loaded = hrm
    ids = random_ids(2, 20, seed=2)
    with torch.no_grad():
        cache = loaded.model.new_cache(2, 20)
        parts = [loaded.model(ids[:, :12], cache=cache)]
        parts += [loaded.model(ids[:, t:t + 1], cache=cache) for t in range(12, 20)]
        theirs = reference(ids, token_type_ids=_typed(20, 12).expand(2, -1)).logits
        causal = reference(ids).logits
    stepped = torch.cat(parts, dim=1)
    result = compare(stepped, theirs)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, result
    assert compare(stepped, causal)["max_relative_error"] > 1e-2  # the prompt's two-way reading shows


def test_a_read_without_a_cache_scores_every_position_causally(hrm):
    _, reference, loaded = hrm
    ids = random_ids(2, 20, seed=3)
    with torch.no_grad():
        result = compare(loaded.model(ids), reference(ids).logits)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, result


def test_greedy_generation_equals_transformers_given_the_prompt_as_token_type_ids(hrm):
    _, reference, loaded = hrm
    prompt = random_ids(1, 7, seed=1)
    with torch.no_grad():
        theirs = reference.generate(prompt, token_type_ids=torch.ones_like(prompt), max_new_tokens=12,
                                    do_sample=False)[0, 7:].tolist()
    assert generate(loaded.model, [prompt[0].tolist()], Sampling(max_new_tokens=12), ())[0] == theirs


def test_left_padded_prompts_batched_equal_each_alone(hrm):
    _, _, loaded = hrm
    ps = [random_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 9, 6)]
    sampling = Sampling(max_new_tokens=8)
    assert generate(loaded.model, ps, sampling, ()) == [generate(loaded.model, [p], sampling, ())[0] for p in ps]


def test_the_engine_reads_each_prompt_whole_and_equals_the_static_cache(hrm):
    directory, _, loaded = hrm
    ps = prompts(6, seed=1, lo=3, hi=14)
    lengths = [9, 4, 12, 1, 7, 10]
    # sixteen tokens a step and few blocks: prompts wait for a step with room for all of them, beside other
    # requests' decodes, and some are preempted and read again
    with open_engine(directory, max_step_tokens=16, max_blocks=24) as engine:
        got = run_all(engine, ps, lengths)
        again = engine.submit(ps[0], SamplingParams(max_tokens=5, ignore_eos=True)).result()
        stats = engine.stats()
    for p, n, tokens in zip(ps, lengths, got):
        assert tokens == generate(loaded.model, [p], Sampling(max_new_tokens=n), ())[0]
    assert stats["prefix_caching"] is False and again.cached_tokens == 0
    assert stats["steps"] < sum(lengths)  # requests shared steps


def test_a_prompt_longer_than_a_chunk_is_refused_by_the_scheduler():
    scheduler = Scheduler(BlockPool(64, 4, prefix_caching=False), max_step_tokens=8, whole_prompt=True)
    with pytest.raises(ValueError, match="read whole, in one chunk"):
        scheduler.add(Sequence("long", list(range(3, 12)), 9, 4))
    with pytest.raises(ValueError, match="cannot share prefixes"):
        Scheduler(BlockPool(64, 4), whole_prompt=True)


def test_every_pass_is_a_layer_of_its_own_over_weights_held_once(hrm):
    _, reference, loaded = hrm
    model, cfg = loaded.model, loaded.cfg
    assert (cfg.num_layers, cfg.loop_layers, len(cfg.loop_schedule)) == (16, 2, 8)
    assert [stack for stack, _, _ in cfg.loop_schedule] == [0, 0, 0, 1] * 2
    assert len(model.new_cache(1, 4).keys) == 16  # every pass its own key-value slots
    held = sum(p.numel() for p in model.parameters())  # tied parameters are listed once
    assert held == sum(p.numel() for p in reference.parameters())
    assert all(name.startswith(("stacks.", "loop_init", "embed", "lm_head", "final_norm"))
               for name, _ in model.named_parameters())
    seen = []
    remove = model.add_hook(15, lambda h: seen.append(h.shape))
    with torch.no_grad():
        model(random_ids(1, 5))
    remove()
    assert seen == [torch.Size([1, 5, BASE_CONFIG["hidden_size"]])]


def test_hrm_text_is_listed_parity_checked_against_transformers():
    row = {row["family"]: row for row in family_table()}["hrm_text"]
    assert row["status"] == "parity-checked" and row["reference"] == "HrmTextForCausalLM"


@pytest.mark.parametrize("change, message", [
    ({"H_cycles": 0}, "H_cycles is 0"),
    ({"L_cycles": "three"}, "L_cycles is 'three'"),
    ({"num_layers_per_stack": -1}, "num_layers_per_stack is -1"),
])
def test_what_hrm_text_cannot_state_is_refused_before_any_weight(hrm, tmp_path, change, message):
    config = {**json.loads((hrm[0] / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    build_tiny_tokenizer(tmp_path)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(tmp_path)))
    assert message in str(refused.value) and "\n" not in str(refused.value)
