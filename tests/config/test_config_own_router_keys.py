"""Routing, layer-pattern and attention keys of Hy3, AFMoE, Sarvam-105B, A.X-K1 and Muse Glimmer
that their tiny parity checkpoints cannot reach (keys Transformers' classes ignore or rewrite when
saving), read from hand-written configs."""

from __future__ import annotations

import pytest

from ster_dist.config import from_hf
from ster_dist.errors import Refusal

_SMALL = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 256,
    "intermediate_size": 128,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
_LATENT = {
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
}


def _raw(family: str, **keys) -> dict:
    return {"model_type": family, **_SMALL, **keys}


@pytest.mark.parametrize("route_norm", [None, True, False])
def test_hy_v3_route_norm_and_scaling(route_norm):
    raw = _raw("hy_v3", router_scaling_factor=1.5, num_shared_experts=2)
    if route_norm is not None:
        raw["route_norm"] = route_norm
    mc = from_hf(raw)
    assert mc.moe.renormalize == (route_norm is not False) and mc.moe.scaling_factor == 1.5
    assert mc.moe.scoring == "sigmoid" and mc.moe.correction_bias and mc.moe.topk_method == "greedy"
    assert mc.moe.shared_intermediate_size == 64 and mc.moe_layers == (False, True, True, True)


def test_afmoe_unstated_pattern_score_func_and_mup():
    mc = from_hf(_raw("afmoe", num_dense_layers=2, route_scale=2.0, mup_enabled=True))
    # every fourth layer full attention and unrotated, the rest sliding and rotated
    assert [w is not None for w in mc.layer_window] == [True, True, True, False]
    assert [r is not None for r in mc.layer_rope] == [True, True, True, False]
    assert (
        mc.moe_layers == (False, False, True, True)
        and mc.moe.scaling_factor == 2.0
        and mc.moe.renormalize
    )
    assert mc.embed_scale == 8.0 and mc.attn_output_gate and mc.post_attn_norm and mc.post_mlp_norm
    softmax = from_hf(_raw("afmoe", score_func="softmax"))
    assert (
        softmax.moe.scoring == "softmax"
        and not softmax.moe.renormalize
        and softmax.embed_scale == 1.0
    )
    with pytest.raises(Refusal, match="attention_bias"):
        from_hf(_raw("afmoe", attention_bias=True))


def test_afmoe_full_layers_stay_unrotated_without_a_window():
    mc = from_hf(
        _raw("afmoe", sliding_window=None, layer_types=["sliding_attention", "full_attention"] * 2)
    )
    assert [r is not None for r in mc.layer_rope] == [True, False, True, False]
    assert all(w is None for w in mc.layer_window)


def test_sarvam_mla_own_spellings():
    raw = _raw(
        "sarvam_mla",
        **_LATENT,
        head_dim=20,
        num_shared_experts=2,
        moe_shared_expert_intermediate_size=24,
        rope_theta=10000.0,
        max_position_embeddings=128,
        rope_scaling={
            "type": "deepseek_yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    mc = from_hf(raw)
    assert mc.layer_rope[0].rope_type == "yarn" and mc.layer_rope[0].interleaved
    assert mc.mla is not None and mc.head_dim == 12
    assert (
        mc.moe.topk_method == "noaux_tc" and mc.moe.correction_bias and mc.moe.scaling_factor == 2.5
    )
    assert mc.moe.shared_intermediate_size == 48 and mc.moe_layers == (False, True, True, True)
    greedy = from_hf({**raw, "moe_router_enable_expert_bias": False, "score_function": "softmax"})
    assert (
        greedy.moe.topk_method == "greedy"
        and not greedy.moe.correction_bias
        and greedy.moe.scoring == "softmax"
    )
    with pytest.raises(Refusal, match="moe_router_enable_expert_bias"):
        from_hf({**raw, "moe_router_enable_expert_bias": False, "n_group": 2, "topk_group": 1})


def test_axk1_groups_ranked_by_best_expert_without_a_bias_and_sparse_post_norms():
    mc = from_hf(
        _raw(
            "axk1",
            **{**_LATENT, "q_lora_rank": 24},
            n_group=4,
            topk_group=2,
            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        )
    )
    assert mc.moe.topk_method == "group_limited_greedy" and not mc.moe.correction_bias
    assert mc.moe.scoring == "sigmoid" and mc.moe.renormalize and mc.moe.scaling_factor == 2.5
    assert [mc.post_mlp_norm_at(i) for i in range(4)] == [
        False,
        True,
        False,
        True,
    ] and not mc.post_attn_norm
    stated = from_hf(
        _raw(
            "axk1",
            **{**_LATENT, "q_lora_rank": 24},
            n_group=4,
            topk_group=2,
            topk_method="noaux_tc",
        )
    )
    assert stated.moe.topk_method == "noaux_tc" and stated.moe.correction_bias
    assert [stated.post_mlp_norm_at(i) for i in range(4)] == [False, True, True, True]


def test_muse_glimmer_text_switches_transformers_lacks():
    raw = {
        "model_type": "muse_glimmer_text",
        **{k: v for k, v in _SMALL.items() if "expert" not in k},
        "num_hidden_layers": 8,
        "rope_theta": 5000.0,
    }
    mc = from_hf(raw)
    # every fourth layer from the last attends fully and unrotated
    assert [w is None for w in mc.layer_window] == [False, False, False, True] * 2
    assert [r is None for r in mc.layer_rope] == [False, False, False, True] * 2
    assert mc.layer_rope[0].theta == 5000.0 and mc.attn_output_gate and mc.qk_norm == "head"
    assert (
        mc.attn_scale == pytest.approx(3.87 / 4)
        and mc.post_norm_eps == 1e-8
        and mc.final_norm_offset == 0.0
    )
    assert mc.logit_softcap == 20.0 and mc.logit_multiplier == pytest.approx(0.19611613513818404)
    # the native schema's factor holds sqrt(head_dim) already; scale_query_by wins over both
    assert from_hf({**raw, "qk_scale_factor": 8.0}).attn_scale == pytest.approx(8.0 / 4 / 4)
    assert from_hf({**raw, "scale_query_by": 2.0}).attn_scale == pytest.approx(2.0 / 4)
    off = from_hf({**raw, "use_qk_norm": False, "use_attn_output_gate": False})
    assert (
        off.qk_norm == "none" and not off.attn_output_gate and off.attn_scale == pytest.approx(0.25)
    )
    with pytest.raises(Refusal, match="attention_bias"):
        from_hf({**raw, "attention_bias": True})
