"""Tiny checkpoints of ster_dist/families/deepseek.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, kv_lora_rank=16,
        q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    # latent attention with YaRN, sigmoid noaux_tc routing, a dense middle layer named by mlp_layer_types
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, n_group=4, topk_group=2,
        routed_scaling_factor=1.8, mlp_layer_types=["sparse", "dense", "sparse"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, scale_emb=2.0,
        scale_depth=1.4, dim_model_base=32)),
}
