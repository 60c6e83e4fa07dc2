"""Tiny Transformers checkpoints of the families in ster_dist/families/moe_variants.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

TINY_MOE_VARIANTS: dict[str, tuple[str, str, dict]] = {
    # GraniteMoE's multipliers and experts with a fused shared_mlp beside them
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, intermediate_size=24,
        shared_intermediate_size=40, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=4.0)),
    # OLMo 2's post-norms and whole-projection query/key norms over unrenormalised softmax routing
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(
        num_key_value_heads=2, num_experts=7, num_experts_per_tok=2, intermediate_size=24)),
    # latent attention with YaRN, sigmoid noaux_tc routing, a dense middle layer named by mlp_layer_types
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, n_group=4, topk_group=2,
        routed_scaling_factor=1.8, mlp_layer_types=["sparse", "dense", "sparse"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    # biases everywhere, adjacent-pair rotation, a selection bias, shared experts, a dense first layer
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        num_key_value_heads=2, use_bias=True, moe_num_experts=8, moe_k=2, moe_intermediate_size=16,
        moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1)),
    # per-head query/key norms after the rotation, the alpha-scaled base, a per-layer moe_topk list, a shared mlp
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, attention_bias=True, num_experts=6, moe_topk=[2, 2, 2],
        intermediate_size=24, rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                               "rope_theta": 10000.0})),
}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_MOE_VARIANTS: dict[str, str] = {}
