"""The Mamba-2 layer kind beyond tests/families/test_parity.py, for every family of the kind: a long
prompt read in chunks (static cache, and paged steps with a state slot per sequence) equals one pass
and Transformers; each tensor-parallel rank holds whole groups or a share of a replicated one, and
its state is its heads' only; bad config values and a tensor parallelism that would split a group
unevenly are refused in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.layers.ssd_scan import ssd_scan
from ster_dist.model.decoder import meta_decoder
from ster_dist.model.paged import Chunk, PagedCache
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.recurrent_checks import (
    PagedStatesOnRank,
    check_long_prompt_in_chunks,
    check_paged_steps,
    one_line_refusal,
    paged_tokens,
    random_ids,
    run_paged,
    variants_fixture,
)

VARIANTS = ["mamba2", "bamba", "nemotron_h", "granitemoehybrid", "granitemoehybrid_dense"]


tiny = variants_fixture(VARIANTS)


def test_chunked_scan_equals_the_recurrence_token_by_token():
    """The closed form over 64-token chunks equals S_t = exp(dt_t a) S_{t-1} + dt_t x_t B_t^T, y_t =
    S_t C_t + D x_t stepped token by token; a token with dt = 0 and x = 0 leaves the state as it
    was."""
    gen = torch.Generator().manual_seed(0)
    n, t, h, p, k = 2, 150, 3, 4, 5

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, b, c, state = randn(n, t, h, p), randn(n, t, h, k), randn(n, t, h, k), randn(n, h, p, k)
    dt, a, d = (
        torch.rand(n, t, h, generator=gen, dtype=torch.float64),
        -torch.rand(h, dtype=torch.float64),
        randn(h),
    )
    dt[0, 70:90], x[0, 70:90] = 0, 0  # padding inside a sequence: the state passes through
    y, final = ssd_scan(x, dt, a, b, c, d, state)
    s, ys = state.clone(), []
    for i in range(t):
        s = (
            s * (dt[:, i] * a).exp()[..., None, None]
            + (dt[:, i, :, None] * x[:, i])[..., None] * b[:, i, :, None]
        )
        ys.append(torch.einsum("nhpk,nhk->nhp", s, c[:, i]) + d[:, None] * x[:, i])
        if i == 69:
            before = s[0].clone()
    assert torch.allclose(y, torch.stack(ys, dim=1), atol=1e-10) and torch.allclose(
        final, s, atol=1e-10
    )
    _, held = ssd_scan(
        x[:, 70:90], dt[:, 70:90], a, b[:, 70:90], c[:, 70:90], d, before.expand(n, -1, -1, -1)
    )
    assert torch.allclose(held[0], before, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_prompt_in_chunks_equals_one_pass_and_transformers(tiny, variant):
    reference, model = tiny[variant][:2]
    check_long_prompt_in_chunks(model, reference)


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_steps_carry_each_sequences_state_in_its_slot(tiny, variant):
    """Prefill chunks of two sequences in their own slots, packed with each other's decodes, equal
    whole reads."""
    check_paged_steps(tiny[variant][1], paged_tokens(), variant)


def test_tensor_parallel_ranks_keep_their_heads_states_and_agree_with_one_rank(tiny):
    """Paged steps at TP=2 (two whole groups, and one group split over the ranks) equal one rank's;
    each rank's state slots hold its own heads' states."""
    tokens = paged_tokens()
    with SpawnGroup(2) as group:
        for variant in ("mamba2", "bamba"):
            group.call("load", resolve(str(tiny[variant][3])), "f32", "cpu")
            ranks = group.on(PagedStatesOnRank).run(tokens)
            _, single, cache = run_paged(tiny[variant][1], tokens)
            for tp2, tp1 in zip(ranks[0]["logits"], single):
                assert compare(tp2, tp1)["max_relative_error"] < 1e-5, variant
            (conv_slots, conv_channels, kernel), (ssm_slots, heads, head_dim, state) = (
                tuple(s.shape) for s in cache.states[min(cache.states)]
            )
            # B and C channels: replicated when one group is split
            bc = conv_channels - heads * head_dim
            local_bc = bc // 2 if variant == "mamba2" else bc
            assert [r["state_shapes"] for r in ranks] == [
                [
                    (conv_slots, heads // 2 * head_dim + local_bc, kernel),
                    (ssm_slots, heads // 2, head_dim, state),
                ]
            ] * 2


@pytest.mark.parametrize(
    "variant, tp, expected",
    [
        # (heads, groups) per rank: two groups over two ranks, one each with its four heads
        ("mamba2", 2, [((0, 4), (0, 1)), ((4, 8), (1, 2))]),
        # one group over two ranks: replicated, its eight heads split
        ("bamba", 2, [((0, 4), (0, 1)), ((4, 8), (0, 1))]),
        ("mamba2", 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),
        ("nemotron_h", 2, [((0, 4), (0, 1)), ((4, 8), (1, 2))]),
        ("granitemoehybrid", 2, [((0, 4), (0, 1)), ((4, 8), (1, 2))]),
    ],
)
def test_each_rank_holds_its_heads_groups_and_state(tiny, variant, tp, expected):
    raw = tiny[variant][2]
    cfg = from_hf(raw)
    got = []
    for rank in range(tp):
        decoder = meta_decoder(cfg, ParallelCtx(rank, tp))
        mixer = next(block.token_mixer for block in decoder.layers if block.site == "mixer")
        sh = mixer.shares
        got.append(((sh.h0, sh.h1), (sh.g0, sh.g1)))
        heads, groups = sh.h1 - sh.h0, sh.g1 - sh.g0
        assert mixer.state_shapes() == ((heads * 12 + 2 * groups * 16, 3), (heads, 12, 16))
        assert tuple(mixer.in_proj.weight.shape) == (2 * heads * 12 + 2 * groups * 16 + heads, 48)
        assert tuple(mixer.out_proj.weight.shape) == (48, heads * 12)
    assert got == expected


@pytest.mark.parametrize(
    "variant, change, words",
    [
        ("mamba2", {"n_groups": 3}, "n_groups"),
        ("mamba2", {"num_heads": 0}, "mamba_n_heads"),
        ("mamba2", {"head_dim": 10}, "expand"),
        ("mamba2", {"state_size": "16"}, "mamba_d_state"),
        ("mamba2", {"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
        ("mamba2", {"time_step_limit": "wide"}, "time_step_limit"),
        ("mamba2", {"hidden_act": "gelu"}, "activation"),
        ("bamba", {"attn_layer_indices": [5]}, "attn_layer_indices"),
        ("bamba", {"mamba_n_groups": 3}, "n_groups"),
        ("bamba", {"mamba_d_conv": -1}, "mamba_d_conv"),
        ("nemotron_h", {"moe_latent_size": 0}, "moe_latent_size"),
        (
            "nemotron_h",
            {"layers_block_type": None, "hybrid_override_pattern": "M*X"},
            "layer pattern",
        ),
        ("nemotron_h", {"mamba_num_heads": 5}, "n_groups"),
        ("granitemoehybrid", {"layer_types": None}, "layer_types"),
        ("granitemoehybrid", {"layer_types": ["mamba", "attention", "moe"]}, "layer_types"),
        ("granitemoehybrid", {"shared_intermediate_size": None}, "shared_intermediate_size"),
        ("granitemoehybrid", {"position_embedding_type": "alibi"}, "position_embedding_type"),
        ("granitemoehybrid_dense", {"mamba_n_groups": 3}, "n_groups"),
    ],
)
def test_bad_config_values_are_refused(tiny, variant, change, words):
    assert words in one_line_refusal({**tiny[variant][2], **change})


@pytest.mark.parametrize(
    "variant, change, tp",
    [
        # two groups cannot be shared by three ranks
        ("mamba2", {}, 3),
        # one group of two heads over four ranks
        ("bamba", {"mamba_n_heads": 2, "mamba_d_head": 48}, 4),
    ],
)
def test_a_tensor_parallelism_that_would_split_a_group_is_refused(tiny, variant, change, tp):
    assert "--tp" in one_line_refusal({**tiny[variant][2], **change}, tp)


def test_bad_state_never_leaks_into_a_fresh_sequence(tiny):
    """A slot reused by a new sequence starts from zero state, whatever its last owner left
    there."""
    model = tiny["mamba2"][1]
    cache = PagedCache(model, num_blocks=16, block_size=4, state_slots=1)
    for states in cache.states.values():
        for s in states:
            s.fill_(3.0)
    ids = random_ids(9, seed=3)[0]
    with torch.no_grad():
        got = model.forward_paged(ids, [replace(Chunk(tuple(range(1, 4)), 0, 9), state=0)], cache)
        whole = model(ids[None])[0, -1]
    assert compare(got, whole[None])["max_relative_error"] < 1e-5
