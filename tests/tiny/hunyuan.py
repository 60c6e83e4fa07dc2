"""Tiny checkpoints of ster_dist/families/hunyuan.py's families."""

from __future__ import annotations

# the alpha-scaled fixed base HunYuan's configs state (copied per entry: a config class may fill in
# the dict)
_ALPHA_ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}

TINY: dict[str, tuple[str, str, dict]] = {
    # query/key norms after the rotation, a fixed alpha-scaled base
    "hunyuan_v1_dense": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            rope_parameters={**_ALPHA_ROPE},
        ),
    ),
    # per-head query/key norms after the rotation, the alpha-scaled base, a per-layer moe_topk list,
    # a shared mlp
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            num_experts=6,
            moe_topk=[2, 2, 2],
            intermediate_size=24,
            rope_parameters={**_ALPHA_ROPE},
        ),
    ),
    # per-head query/key norms before the rotation, sigmoid routing with a selection bias under its
    # own names, a
    # dense first layer and a sparse middle one named by mlp_layer_types, a shared expert
    "hy_v3": (
        "HYV3Config",
        "HYV3ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
            router_scaling_factor=1.7,
            mlp_layer_types=["dense", "sparse", "sparse"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}
