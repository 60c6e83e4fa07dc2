"""The Kimi delta attention layer kind (model/kimi_delta.py) on a tiny Kimi-Linear checkpoint: the
delta-rule scan with a decay per key channel against Transformers' own KDA functions, a long prompt
read in chunks (static cache and paged state slots) equal to one pass, left padding leaving the
state alone, each tensor-parallel rank's share of heads, channels and checkpoint rows, and refusals
of configs it cannot run."""

from __future__ import annotations

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.model.gated_delta import delta_rule_chunked, delta_rule_recurrent
from ster_dist.model.kimi_delta import l2norm
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
from tests.tiny_models import read_config

tiny, loaded = checkpoint_fixtures("kimi_linear")


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_both_scans_with_a_decay_per_key_channel_equal_transformers_kda(length):
    from transformers.models.kimi_linear import modeling_kimi_linear as ref

    gen = torch.Generator().manual_seed(length)
    n, heads, dk = 2, 3, 8
    q, k, v = (torch.randn(n, length, heads, dk, generator=gen) for _ in range(3))
    g = -torch.rand(n, length, heads, dk, generator=gen) * 2
    beta = torch.rand(n, length, heads, generator=gen)
    state = torch.randn(n, heads, dk, dk, generator=gen)
    mine = (l2norm(q) * dk**-0.5, l2norm(k), v, g, beta, state)
    for ours_fn in (delta_rule_recurrent, delta_rule_chunked):
        ours, ours_state = ours_fn(*mine)
        for fn in (ref.chunk_kimi_delta_attention, ref.recurrent_kimi_delta_attention):
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


def test_the_layers_kda_layers_names_run_delta_attention_and_the_rest_unrotated_latent_attention(
    tiny,
):
    cfg = from_hf(read_config(tiny))
    assert cfg.mixers == ("kimi_delta", "latent_attention", "kimi_delta")
    assert cfg.feed_forwards == ("dense", "moe", "moe")
    assert cfg.layer_rope == (None, None, None)
    assert cfg.moe.scoring == "sigmoid" and cfg.moe.correction_bias and cfg.moe.renormalize
    assert (
        cfg.moe.n_group == 2
        and cfg.moe.topk_group == 1
        and cfg.moe.scaling_factor == pytest.approx(2.446)
    )


def test_tensor_parallel_ranks_hold_whole_heads_and_read_only_their_rows(tiny):
    cfg = from_hf(read_config(tiny))
    dk, heads, hidden = 12, 2, cfg.hidden_size
    attn = "model.layers.0.self_attn"
    shapes = {
        f"{attn}.q_proj.weight": (heads * dk, hidden),
        f"{attn}.k_conv1d.weight": (heads * dk, 1, 4),
        f"{attn}.f_a_proj.weight": (dk, hidden),
        f"{attn}.f_b_proj.weight": (heads * dk, dk),
        f"{attn}.b_proj.weight": (heads, hidden),
        f"{attn}.dt_bias": (heads * dk,),
        f"{attn}.o_proj.weight": (hidden, heads * dk),
        # latent attention's q_proj and o_proj carry the same names in its layer
        "model.layers.1.self_attn.q_proj.weight": (4 * 20, hidden),
    }
    for rank in range(2):
        decoder = meta_decoder(cfg, ParallelCtx(rank, 2))
        # one head each: its query, key and value convolution channels, its [dk, dk] state
        assert decoder.layers[0].token_mixer.state_shapes() == ((3 * dk, 3), (1, dk, dk))
        plan = build_plan(cfg.spec, cfg, decoder.shards(), shapes)
        rows = {
            read.param: [
                (p.rows.start, p.rows.stop) if p.rows is not None else None for p in read.pieces
            ]
            for read in plan.reads
        }
        mine = [(rank * dk, (rank + 1) * dk)]
        for param in ("q.weight", "k_conv", "f_b.weight", "dt_bias"):
            assert rows[f"layers.0.mixer.{param}"] == mine, param
        assert rows["layers.0.mixer.b.weight"] == [(rank, rank + 1)]
        # narrow: whole on every rank
        assert rows["layers.0.mixer.f_a.weight"] in ([(0, dk)], [None])
        (out,) = [read for read in plan.reads if read.param == "layers.0.mixer.out.weight"]
        # o_proj: this rank's columns
        assert [(p.cols.start, p.cols.stop) for p in out.pieces] == mine
        assert rows["layers.1.attn.q.weight"] == [(rank * 2 * 20, (rank + 1) * 2 * 20)]


def test_more_ranks_than_heads_is_refused(tiny):
    cfg = from_hf(read_config(tiny))
    with pytest.raises(Refusal, match="2 heads, fewer than the 4 tensor-parallel ranks"):
        meta_decoder(cfg, ParallelCtx(0, 4))


_LINEAR = dict(
    kda_layers=[1, 3], full_attn_layers=[2], num_heads=2, head_dim=12, short_conv_kernel_size=4
)


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(kv_lora_rank=None), "kv_lora_rank is not stated"),
        (dict(linear_attn_config=None), "linear_attn_config is None"),
        (
            dict(linear_attn_config={**_LINEAR, "head_dim": None}),
            "linear_attn_config.head_dim is None",
        ),
        (
            dict(linear_attn_config={**_LINEAR, "short_conv_kernel_size": 0}),
            "linear_attn_config.short_conv_kernel_size is 0",
        ),
        (dict(linear_attn_config={**_LINEAR, "kda_layers": [1, 4]}), "kda_layers is [1, 4]"),
        (dict(moe_router_activation_func="softmax"), "moe_router_activation_func is 'softmax'"),
        (dict(mla_use_output_gate=True), "mla_use_output_gate is set"),
    ],
)
def test_configs_it_cannot_run_are_refused(tiny, tmp_path, changes, words):
    with pytest.raises(Refusal, match=words.replace("(", r"\(").replace("[", r"\[")):
        load_model(resolve(str(edited_copy(tiny, tmp_path, **changes))), "f32")


# sizes modelled on Kimi-Linear-48B-A3B's config.json (no layer_types: kda_layers says which layers
# are linear)
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
    },
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "vocab_size": 163840,
    "model_max_length": 1048576,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def test_kimi_linear_48b_sizes_split_over_eight_ranks():
    cfg = from_hf(KIMI_LINEAR_48B)
    assert cfg.mixers.count("latent_attention") == 7 and cfg.mixers[3] == "latent_attention"
    assert cfg.feed_forwards[0] == "dense" and set(cfg.feed_forwards[1:]) == {"moe"}
    assert (
        cfg.max_position == 1048576
        and cfg.moe.top_k == 8
        and cfg.moe.shared_intermediate_size == 1024
    )
    for rank in (0, 7):
        decoder = meta_decoder(cfg, ParallelCtx(rank, 8), torch.bfloat16)
        assert decoder.layers[0].token_mixer.state_shapes() == ((3 * 4 * 128, 3), (4, 128, 128))
