"""The gated delta-rule layer kind (model/gated_delta.py) on tiny Qwen3-Next and Qwen3.5
checkpoints: its scan against Transformers' own delta-rule functions, a long prompt read in chunks
(static cache and paged state slots) equal to one pass, left padding leaving the state alone, each
tensor-parallel rank's share of heads, channels and checkpoint rows, and refusals of configs it
cannot run."""

from __future__ import annotations

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.model.gated_delta import delta_rule_chunked, delta_rule_recurrent, l2norm
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.shard.plan import build_plan
from tests.recurrent_checks import (
    check_chunks_equal_one_pass,
    check_driver_slots,
    check_left_padding,
    checkpoint_fixtures,
    edited_copy,
    random_ids,
)
from tests.tiny_models import make_tiny, read_config

tiny, loaded = checkpoint_fixtures("qwen3_next")


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_both_scans_equal_transformers_chunked_and_recurrent_delta_rule(length):
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    gen = torch.Generator().manual_seed(length)
    n, key_heads, value_heads, dk, dv = 2, 2, 6, 8, 12
    q, k = (torch.randn(n, length, key_heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(n, length, value_heads, dv, generator=gen)
    g = -torch.rand(n, length, value_heads, generator=gen) * 2
    beta = torch.rand(n, length, value_heads, generator=gen)
    state = torch.randn(n, value_heads, dk, dv, generator=gen)
    groups = value_heads // key_heads
    mine = (
        l2norm(q).repeat_interleave(groups, 2) * dk**-0.5,
        l2norm(k).repeat_interleave(groups, 2),
        v,
        g,
        beta,
        state,
    )
    for ours_fn in (delta_rule_recurrent, delta_rule_chunked):
        ours, ours_state = ours_fn(*mine)
        for fn in (ref.torch_chunk_gated_delta_rule, ref.torch_recurrent_gated_delta_rule):
            theirs, theirs_state = fn(
                q,
                k,
                v,
                g=g,
                beta=beta,
                initial_state=state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            assert compare(ours, theirs)["max_relative_error"] < 1e-4, (
                ours_fn.__name__,
                fn.__name__,
            )
            assert compare(ours_state, theirs_state)["max_relative_error"] < 1e-4, (
                ours_fn.__name__,
                fn.__name__,
            )


def test_a_long_prompt_read_in_chunks_equals_one_pass(loaded):
    check_chunks_equal_one_pass(
        loaded.model, random_ids(90, seed=3, batch=2), (17, 1, 40, 29, 1, 1, 1), 96, 1e-4
    )


def test_paged_chunks_continue_each_sequences_state_in_its_slot(loaded):
    """Two sequences through state slots: one read in uneven chunks beside the other's prompt and
    decoding; each step's last-token logits equal the whole read's at that position."""
    tokens = {"long": random_ids(60, seed=4)[0], "short": random_ids(12, seed=5)[0]}
    schedule = [
        [("long", 23), ("short", 9)],
        [("long", 20), ("short", 1)],
        [("short", 1), ("long", 17)],
        [("short", 1)],
    ]
    check_driver_slots(loaded.model, tokens, schedule)


def test_left_padding_leaves_the_state_of_a_fresh_sequence(loaded):
    check_left_padding(loaded.model)


def test_tensor_parallel_ranks_hold_whole_key_head_groups_and_read_only_their_rows(tiny):
    cfg = from_hf(read_config(tiny))
    raw = cfg.raw
    dk, dv, per_key = raw["linear_key_head_dim"], raw["linear_value_head_dim"], 2
    # one key head's query, key, values and output gates in in_proj_qkvz
    group_rows = 2 * dk + 2 * per_key * dv
    shapes = {
        "model.layers.0.linear_attn.in_proj_qkvz.weight": (2 * group_rows, cfg.hidden_size),
        "model.layers.0.linear_attn.in_proj_ba.weight": (4 * per_key, cfg.hidden_size),
        "model.layers.0.linear_attn.conv1d.weight": (4 * dk + 2 * per_key * dv, 1, 4),
    }
    for rank in range(2):
        decoder = meta_decoder(cfg, ParallelCtx(rank, 2))
        mixer = decoder.layers[0].token_mixer
        # one key head, its two value heads: conv channels of its query, key and values; its heads'
        # states
        assert mixer.state_shapes() == ((2 * dk + per_key * dv, 3), (per_key, dk, dv))
        plan = build_plan(cfg.spec, cfg, decoder.shards(), shapes)
        rows = {
            read.param.rsplit(".", 2)[-2]: [(p.rows.start, p.rows.stop) for p in read.pieces]
            for read in plan.reads
            if read.source.endswith("in_proj_qkvz.weight")
        }
        base = rank * group_rows
        assert rows == {
            "q": [(base, base + dk)],
            "k": [(base + dk, base + 2 * dk)],
            "v": [(base + 2 * dk, base + 2 * dk + per_key * dv)],
            "z": [(base + 2 * dk + per_key * dv, base + group_rows)],
        }
        ba = {
            read.param.rsplit(".", 2)[-2]: [(p.rows.start, p.rows.stop) for p in read.pieces]
            for read in plan.reads
            if read.source.endswith("in_proj_ba.weight")
        }
        assert ba == {
            "b": [(rank * 2 * per_key, rank * 2 * per_key + per_key)],
            "a": [(rank * 2 * per_key + per_key, (rank + 1) * 2 * per_key)],
        }
        (conv,) = [read for read in plan.reads if read.source.endswith("conv1d.weight")]
        key_dim = 2 * dk
        assert [(p.rows.start, p.rows.stop) for p in conv.pieces] == [
            (rank * dk, (rank + 1) * dk),
            (key_dim + rank * dk, key_dim + (rank + 1) * dk),
            (2 * key_dim + rank * per_key * dv, 2 * key_dim + (rank + 1) * per_key * dv),
        ]


def test_qwen3_5_ranks_read_their_rows_of_each_part_of_in_proj_qkv(tmp_path):
    """Qwen3.5 stores every query, then every key, then every value: a rank's query, key and value
    rows are three runs of that tensor, each its own key head's (or its value heads') share."""
    make_tiny("qwen3_5_text", tmp_path)
    cfg = from_hf(read_config(tmp_path))
    dk, dv, per_key = 8, 10, 3
    key_dim, value_dim = 2 * dk, 2 * per_key * dv
    shapes = {
        "model.layers.1.linear_attn.in_proj_qkv.weight": (2 * key_dim + value_dim, cfg.hidden_size),
        "model.layers.1.linear_attn.in_proj_z.weight": (value_dim, cfg.hidden_size),
    }
    for rank in range(2):
        plan = build_plan(cfg.spec, cfg, meta_decoder(cfg, ParallelCtx(rank, 2)).shards(), shapes)
        rows = {
            read.param.rsplit(".", 2)[-2]: [(p.rows.start, p.rows.stop) for p in read.pieces]
            for read in plan.reads
        }
        values = (2 * key_dim + rank * per_key * dv, 2 * key_dim + (rank + 1) * per_key * dv)
        assert rows == {
            "q": [(rank * dk, (rank + 1) * dk)],
            "k": [(key_dim + rank * dk, key_dim + (rank + 1) * dk)],
            "v": [values],
            "z": [(rank * per_key * dv, (rank + 1) * per_key * dv)],
        }


def test_qwen3_5_without_the_attention_output_gate_is_refused(tmp_path):
    make_tiny("qwen3_5_text", tmp_path / "model")
    directory = edited_copy(tmp_path / "model", tmp_path, attn_output_gate=False)
    with pytest.raises(Refusal, match="attn_output_gate is False; only the gated attention layout"):
        load_model(resolve(str(directory)), "f32")


@pytest.mark.parametrize(
    "changes, words",
    [
        (
            dict(linear_num_value_heads=3),
            "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2",
        ),
        (dict(linear_key_head_dim=None), "linear_key_head_dim is None"),
        (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim is 0"),
        (
            dict(layer_types=["linear_attention", "sliding_attention", "linear_attention"]),
            "layer type 'sliding_attention' is not supported for qwen3_next",
        ),
        (dict(layer_types=None), "neither layer_types nor a positive full_attention_interval"),
    ],
)
def test_configs_it_cannot_run_are_refused(tiny, tmp_path, changes, words):
    with pytest.raises(Refusal, match=words.replace("(", r"\(")):
        load_model(resolve(str(edited_copy(tiny, tmp_path, **changes))), "f32")


def test_a_stated_full_attention_interval_places_the_attention_layers(tiny, tmp_path):
    cfg = from_hf(
        read_config(edited_copy(tiny, tmp_path, layer_types=None, full_attention_interval=2))
    )
    assert cfg.mixers == ("gated_delta", "attention", "gated_delta")
    assert cfg.feed_forwards == ("dense", "moe", "moe")


def test_more_ranks_than_key_heads_is_refused(tiny):
    cfg = from_hf(read_config(tiny))
    with pytest.raises(Refusal, match="2 key heads, fewer than the 4 tensor-parallel ranks"):
        meta_decoder(cfg, ParallelCtx(0, 4))


# the sizes Qwen3-Next-80B-A3B's config.json states (no layer_types: every fourth layer attends)
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 5120,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}


def test_the_published_qwen3_next_sizes_split_over_eight_ranks():
    cfg = from_hf(QWEN3_NEXT_80B)
    assert cfg.mixers == ("gated_delta", "gated_delta", "gated_delta", "attention") * 12
    assert set(cfg.feed_forwards) == {"moe"} and cfg.moe.shared_gate and cfg.moe.renormalize
    assert cfg.attn_output_gate and cfg.layer_rope[3].rotary_dim == 64 and cfg.layer_rope[0] is None
    # one key head's rows of in_proj_qkvz: q, k, two values, two gates
    hidden, group = 2048, 2 * 128 + 2 * 2 * 128
    shapes = {
        "model.layers.0.linear_attn.in_proj_qkvz.weight": (16 * group, hidden),
        "model.layers.3.self_attn.q_proj.weight": (16 * 2 * 256, hidden),
    }
    for rank in (0, 7):
        decoder = meta_decoder(cfg, ParallelCtx(rank, 8), torch.bfloat16)
        # two key heads and their four value heads per rank: 2 x 128 query and key channels, 4 x 128
        # values
        assert decoder.layers[0].token_mixer.state_shapes() == ((2 * 256 + 512, 3), (4, 128, 128))
        plan = build_plan(cfg.spec, cfg, decoder.shards(), shapes)
        rows = {
            read.param: [(p.rows.start, p.rows.stop) for p in read.pieces] for read in plan.reads
        }
        first = 2 * rank * group
        assert rows["layers.0.mixer.q.weight"] == [
            (first, first + 128),
            (first + group, first + group + 128),
        ]
        # two key-value heads over eight ranks: each rank two query heads (and their gates) of
        # q_proj
        assert rows["layers.3.attn.q.weight"] == [
            (2 * rank * 512, 2 * rank * 512 + 256),
            ((2 * rank + 1) * 512, (2 * rank + 1) * 512 + 256),
        ]
        assert rows["layers.3.attn.gate.weight"] == [
            (2 * rank * 512 + 256, (2 * rank + 1) * 512),
            ((2 * rank + 1) * 512 + 256, (2 * rank + 2) * 512),
        ]
