"""Tiny checkpoints of ster_dist/families/qwen.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        ),
    ),
    # Qwen3-MoE with sliding layers from layer_types, a dense first layer from mlp_layer_types, and
    # a YaRN
    # rotation on full-attention layers beside a plain one at another base on sliding layers
    "mellum": (
        "MellumConfig",
        "MellumForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "rope_theta": 500000.0,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
}
