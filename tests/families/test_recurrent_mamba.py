"""The Mamba-1 layer kind beyond the shared parity tests: a long prompt read in chunks through the
cache equals one pass (static cache and paged state slots), a left-padded batch leaves each row's
state as its unpadded read does, tensor-parallel ranks hold uneven channel shares of the state, and
bad mixer settings are refused naming the key."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.model.paged import PagedCache
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare, run_parity
from ster_dist.resolve import resolve
from tests.paged_steps import Driver
from tests.tiny_models import make_tiny, read_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            directory = tmp_path_factory.mktemp(variant)
            make_tiny(variant, directory)
            made[variant] = directory
        return made[variant]

    return get


@pytest.fixture(scope="module")
def models(checkpoints):
    built = {}

    def get(variant: str):
        if variant not in built:
            built[variant] = load_model(resolve(str(checkpoints(variant))), "f32").model
        return built[variant]

    return get


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", ["mamba_biased", "falcon_mamba", "jamba"])
def test_a_long_prompt_read_in_chunks_equals_one_pass(models, variant):
    model = models(variant)
    ids = _ids(2, 70)
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache(2, 70)
        parts, at = [], 0
        for size in (16, 1, 23, 7, 1, 22):  # uneven chunks, single tokens between them
            parts.append(model(ids[:, at : at + size], cache=cache))
            at += size
    assert at == 70
    assert compare(torch.cat(parts, dim=1), whole)["max_relative_error"] < 1e-5, variant


@pytest.mark.parametrize("variant", ["falcon_mamba", "jamba"])
def test_paged_state_slots_continue_each_sequence(models, variant):
    """Sequences read in chunks of different lengths through the packed forward, each with its own
    state slot (slots out of order) and, for Jamba's attention layer, its own blocks, equal each
    sequence read whole."""
    model = models(variant)
    tokens = {name: _ids(1, 30, seed)[0] for seed, name in enumerate("ABC")}
    slots = {"A": 2, "B": 0, "C": 1}
    driver = Driver(PagedCache(model, 40, 4, state_slots=3))
    schedule = [
        [("A", 5), ("B", 3)],
        [("C", 9), ("B", 4), ("A", 5)],
        [("B", 1), ("C", 1), ("A", 1)],
        [("A", 7), ("C", 1), ("B", 1)],
    ]
    for step in schedule:
        chunks = [replace(driver.chunk(name, n), state=slots[name]) for name, n in step]
        ids = torch.cat(
            [tokens[name][c.start : c.start + c.length] for (name, _), c in zip(step, chunks)]
        )
        with torch.inference_mode():
            logits = model.forward_paged(ids, chunks, driver.cache)
            for row, ((name, _), c) in enumerate(zip(step, chunks)):
                whole = model(tokens[name][None, : c.start + c.length])[0, -1]
                assert compare(logits[row], whole)["max_relative_error"] < 1e-5, (
                    variant,
                    step,
                    name,
                )


def test_left_padding_leaves_the_state_unchanged(models):
    """A left-padded batch, then decoding from its cache: each row equals its prompt read alone."""
    # biased in_proj: padding inputs would not project to zero by themselves
    model = models("mamba_biased")
    prompts = [_ids(1, n, seed=n)[0] for n in (4, 11)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((2, width), dtype=torch.long)
    valid = torch.zeros((2, width), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], valid[row, width - len(p) :] = p, True
    follow = _ids(2, 3, seed=99)
    with torch.no_grad():
        cache = model.new_cache(2, width + 3)
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        batched = [model(ids, positions, valid, cache=cache)[:, -1]]
        for t in range(3):
            batched.append(
                model(follow[:, t : t + 1], positions[:, -1:] + 1 + t, cache=cache)[:, 0]
            )
        for row, p in enumerate(prompts):
            alone = model(torch.cat([p, follow[row]])[None])[0, len(p) - 1 :]
            got = torch.stack([b[row] for b in batched])
            assert compare(got, alone)["max_relative_error"] < 1e-5, row


@pytest.mark.parametrize("variant", ["mamba", "jamba"])
def test_the_parity_report_lines_up_every_layer_with_transformers(checkpoints, variant):
    """Transformers' Mamba lists no embedding state before the layers' (Jamba does): `ster parity`
    pairs each layer with its own output either way."""
    loaded = load_model(resolve(str(checkpoints(variant))), "f32")
    result = run_parity(loaded)
    assert result["passed"] and len(result["layers"]) == loaded.cfg.num_layers, result


def test_tensor_parallel_ranks_hold_uneven_channel_shares_of_the_state(checkpoints):
    """The tiny Mamba's inner width 45 over two ranks: 22 and 23 channels of convolution and scan
    state."""
    cfg = from_hf(read_config(checkpoints("mamba")))
    shapes = [
        meta_decoder(cfg, ParallelCtx(rank, 2)).layers[0].mixer.state_shapes() for rank in range(2)
    ]
    assert shapes == [((22, 2), (22, 5)), ((23, 2), (23, 5))]
    assert meta_decoder(cfg).layers[0].mixer.state_shapes() == ((45, 2), (45, 5))


@pytest.mark.parametrize(
    "key, value",
    [
        ("state_size", 0),
        ("conv_kernel", -1),
        ("time_step_rank", 0),
        ("expand", 0),
        ("use_conv_bias", "yes"),
        ("state_size", 2.5),
    ],
)
def test_bad_mixer_settings_are_refused_naming_the_key(checkpoints, key, value):
    raw = {**read_config(checkpoints("mamba")), key: value}
    with pytest.raises(Refusal, match=key):
        meta_decoder(from_hf(raw))


def test_jamba_layer_pattern_places_attention_and_experts(checkpoints):
    # attention 3k + 1, experts 2k + 1, four layers
    cfg = from_hf(read_config(checkpoints("jamba")))
    assert cfg.mixers == ("mamba", "attention", "mamba", "mamba")
    assert cfg.feed_forwards == ("dense", "moe", "dense", "moe") and cfg.moe_layers == (
        False,
        True,
        False,
        True,
    )
    dense = from_hf({**read_config(checkpoints("jamba")), "num_experts": 1})
    assert dense.feed_forwards == ("dense",) * 4 and not any(dense.moe_layers)


@pytest.mark.parametrize(
    "key, value",
    [
        ("attn_layer_offset", 3),
        ("expert_layer_offset", -1),
        ("attn_layer_period", 0),
        ("mamba_d_state", 0),
        ("mamba_proj_bias", 1),
    ],
)
def test_bad_jamba_settings_are_refused_naming_the_key(checkpoints, key, value):
    raw = {**read_config(checkpoints("jamba")), key: value}
    with pytest.raises(Refusal, match=key):
        meta_decoder(from_hf(raw))


def test_more_ranks_than_inner_channels_is_refused(checkpoints):
    raw = json.loads(json.dumps(read_config(checkpoints("mamba"))))
    raw.update(hidden_size=3, intermediate_size=3)  # the inner width Transformers reads
    with pytest.raises(Refusal, match="lower --tp"):
        meta_decoder(from_hf(raw), ParallelCtx(0, 4))
