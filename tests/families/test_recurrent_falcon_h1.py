"""Falcon-H1's side-by-side layers (attention beside Mamba-2, model/side_by_side.py) beyond
tests/families/test_parity.py: a long prompt read in chunks (static cache, and paged steps with a
state slot per sequence) equals one pass and Transformers; every layer keeps keys and a scan state;
the token engine's continuous batch equals each request alone, with prefix caching off; at TP=2 each
rank holds its heads' share of both parts (whole Mamba groups, or a share of a replicated one) and
agrees with one rank; the checkpoint's tensors are loaded as stored (the muP multipliers act in
forward); bad config values are refused in one line naming the key."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from ster_dist.config import from_hf
from ster_dist.model.decoder import meta_decoder
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.recurrent_checks import (
    LONG,
    PagedStatesOnRank,
    check_long_prompt_in_chunks,
    check_paged_steps,
    one_line_refusal,
    paged_tokens,
    run_paged,
    variants_fixture,
)
from tests.engine.test_recurrent_engine import alone, open_engine, prompts, run_all

# falcon_h1: no gated norm, two Mamba groups; falcon_h1_normed: the norm before the gate, one group,
# biased out_proj
VARIANTS = ["falcon_h1", "falcon_h1_normed"]
# the tiny sizes (tests/tiny/falcon_h1.py): Mamba heads, head width, state; attention's heads,
# key-value heads, width
HEADS, HEAD_DIM, STATE = 8, 12, 16
ATTN_HEADS, KV_HEADS, ATTN_DIM = 4, 2, {"falcon_h1": 16, "falcon_h1_normed": 12}


tiny = variants_fixture(VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_prompt_in_chunks_equals_one_pass_and_transformers(tiny, variant):
    reference, model = tiny[variant][:2]
    cache = check_long_prompt_in_chunks(model, reference)
    # every layer kept its keys (all LONG positions) and its scan's state
    assert set(cache.states) == set(range(len(model.layers)))
    assert all(keys is not None and bool(cache.valid[:, :LONG].all()) for keys in cache.keys)


def test_paged_steps_carry_each_sequences_state_beside_its_keys(tiny):
    """Prefill chunks of two sequences in their own state slots, packed with each other's decodes,
    equal whole reads; the paged cache holds blocks of keys and a state per slot for every layer."""
    variant = "falcon_h1"
    model = tiny[variant][1]
    cache = check_paged_steps(model, paged_tokens(), variant)
    assert all(k is not None for k in cache.keys) and set(cache.states) == set(
        range(len(model.layers))
    )


def test_engine_batch_equals_each_alone_with_prefix_caching_off(tiny):
    directory, reference = tiny["falcon_h1"][3], tiny["falcon_h1"][1]
    ps = prompts(4, seed=1, lo=3, hi=30)
    lengths = [6, 3, 8, 5]
    repeated = ps[0]
    with open_engine(directory, max_step_tokens=6) as engine:  # long prompts read in several chunks
        got = run_all(engine, ps + [repeated], lengths + [6])
        stats = engine.stats()
    for p, n, tokens in zip(ps + [repeated], lengths + [6], got):
        assert tokens == alone(reference, p, n)
    assert stats["prefix_caching"] is False and stats["kv_blocks"]["prefix_hits"] == 0
    assert stats["state_bytes"] > 0


@pytest.mark.parametrize(
    "variant, expected",
    [
        # (Mamba heads, groups) per rank: two groups over two ranks, one each with its four heads
        ("falcon_h1", [((0, 4), (0, 1)), ((4, 8), (1, 2))]),
        # one group over two ranks: replicated, its eight heads split
        ("falcon_h1_normed", [((0, 4), (0, 1)), ((4, 8), (0, 1))]),
    ],
)
def test_each_rank_holds_its_share_of_both_parts(tiny, variant, expected):
    cfg = from_hf(tiny[variant][2])
    got = []
    for rank in range(2):
        block = meta_decoder(cfg, ParallelCtx(rank, 2)).layers[0]
        mamba, attn = block.mixer, block.attn
        sh = mamba.shares
        got.append(((sh.h0, sh.h1), (sh.g0, sh.g1)))
        heads, groups = sh.h1 - sh.h0, sh.g1 - sh.g0
        state_shapes = ((heads * HEAD_DIM + 2 * groups * STATE, 3), (heads, HEAD_DIM, STATE))
        assert (
            mamba.state_shapes() == state_shapes
            and block.token_mixer.state_shapes() == state_shapes
        )
        assert tuple(mamba.in_proj.weight.shape) == (
            2 * heads * HEAD_DIM + 2 * groups * STATE + heads,
            48,
        )
        assert tuple(mamba.conv1d.weight.shape) == (heads * HEAD_DIM + 2 * groups * STATE, 1, 4)
        assert tuple(mamba.out_proj.weight.shape) == (48, heads * HEAD_DIM)
        assert (mamba.norm is None) == (variant == "falcon_h1")
        assert (mamba.out_proj.bias is not None) == (variant == "falcon_h1_normed")
        assert mamba.in_proj.bias is None  # mamba_proj_bias false in both
        d = ATTN_DIM[variant]
        assert (
            attn.kv_shape == block.token_mixer.kv_shape == ((KV_HEADS // 2, d), (KV_HEADS // 2, d))
        )
        assert tuple(attn.q.weight.shape) == (ATTN_HEADS // 2 * d, 48)
    assert got == expected


@pytest.mark.slow  # two spawned ranks: about a minute on two shared cores
def test_tensor_parallel_ranks_keep_their_states_and_agree_with_one_rank(tiny):
    """Paged steps at TP=2 with Falcon-H1's one group split over the ranks (its B and C replicated,
    its gated norm's statistics summed across them) equal one rank's; each rank's state slots hold
    its own heads' states. (Whole groups at TP=2: tests/parallel/test_tensor_parallel.py and the
    shapes above.)"""
    variant, tokens = "falcon_h1_normed", paged_tokens()
    with SpawnGroup(2) as group:
        group.call("load", resolve(str(tiny[variant][3])), "f32", "cpu")
        ranks = group.on(PagedStatesOnRank).run(tokens)
    _, single, _ = run_paged(tiny[variant][1], tokens)
    for tp2, tp1 in zip(ranks[0]["logits"], single):
        assert compare(tp2, tp1)["max_relative_error"] < 1e-5
    local_bc = 2 * STATE  # the one group's B and C on both ranks
    assert [r["state_shapes"] for r in ranks] == [
        [(3, HEADS // 2 * HEAD_DIM + local_bc, 3), (3, HEADS // 2, HEAD_DIM, STATE)]
    ] * 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_checkpoints_tensors_are_loaded_as_stored(tiny, variant):
    """The multipliers act in forward: every part's parameters equal the checkpoint's tensors."""
    model, directory = tiny[variant][1], tiny[variant][3]
    pairs = {
        "model.layers.1.mamba.in_proj.weight": model.layers[1].mixer.in_proj.weight,
        "model.layers.1.mamba.out_proj.weight": model.layers[1].mixer.out_proj.weight,
        "model.layers.1.self_attn.k_proj.weight": model.layers[1].attn.k.weight,
        "model.layers.1.feed_forward.gate_proj.weight": model.layers[1].mlp.gate.weight,
        "model.layers.1.feed_forward.down_proj.weight": model.layers[1].mlp.down.weight,
        "model.embed_tokens.weight": model.embed.weight,
    }
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        for name, param in pairs.items():
            assert torch.equal(f.get_tensor(name), param.detach()), name


@pytest.mark.parametrize(
    "change, words",
    [
        ({"ssm_multipliers": [1.0, 1.0, 1.0, 1.0]}, "ssm_multipliers"),
        ({"mlp_multipliers": [1.0, 1.0, 1.0]}, "mlp_multipliers"),
        ({"attention_in_multiplier": "big"}, "attention_in_multiplier"),
        ({"ssm_out_multiplier": [2.0]}, "ssm_out_multiplier"),
        ({"key_multiplier": "x"}, "key_multiplier"),
        ({"attn_layer_indices": [1]}, "attn_layer_indices"),
        ({"mamba_use_mlp": False}, "mamba_use_mlp"),
        ({"mamba_d_head": 10}, "mamba_d_ssm"),
        ({"mamba_n_groups": 3}, "n_groups"),
        ({"hidden_act": "gelu"}, "activation"),
    ],
)
def test_bad_config_values_are_refused(tiny, change, words):
    assert words in one_line_refusal({**tiny["falcon_h1"][2], **change})
