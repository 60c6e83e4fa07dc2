"""Tiny checkpoints of ster_dist/families/glm.py's families (GLM-4.7-Flash's are in deepseek.py)."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # half of each head rotating by adjacent pairs, biased q/k/v, fused gate_up
    "glm": (
        "GlmConfig",
        "GlmForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5),
    ),
    "glm4": (
        "Glm4Config",
        "Glm4ForCausalLM",
        dict(
            num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.75, tie_word_embeddings=True
        ),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            use_qk_norm=True,
            attention_bias=True,
        ),
    ),
    # Ling 2.0's block under Sarvam's name, run by Transformers as GLM-4-MoE: per-head query/key
    # norms, full
    # rotation, biased query/key/value, grouped sigmoid routing with a selection bias, a shared
    # expert
    "sarvam_moe": (
        "SarvamMoEConfig",
        "Glm4MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            use_qk_norm=True,
            attention_bias=True,
            initializer_range=0.02,
        ),
    ),
}
