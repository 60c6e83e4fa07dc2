"""Tiny checkpoints of ster_dist/families/cohere.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        dict(num_key_value_heads=2, use_qk_norm=True, logit_scale=0.5),
    ),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(
            num_key_value_heads=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            logit_scale=0.5,
            attention_bias=True,
        ),
    ),
    # RMS norms, a dense full-attention first layer that still rotates and is wider, softmax over
    # the chosen
    # experts, a shared expert averaged with the routed ones
    "cohere2_moe": (
        "Cohere2MoeConfig",
        "Cohere2MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=24,
            prefix_dense_intermediate_size=80,
            num_shared_experts=1,
            rms_norm_eps=1e-5,
            logit_scale=0.5,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
    ),
    # bias-free LayerNorms, biased attention, unrenormalised sigmoid scores, shared experts summed,
    # no rotation
    # on the dense prefix
    "cohere2_moe_sigmoid": (
        "Cohere2MoeConfig",
        "Cohere2MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=12,
            num_experts=6,
            num_experts_per_tok=2,
            intermediate_size=24,
            prefix_dense_intermediate_size=40,
            num_shared_experts=2,
            expert_selection_fn="sigmoid",
            norm_topk_prob=False,
            shared_expert_combination_strategy="sum",
            prefix_dense_sliding_window_pattern=2,
            attention_bias=True,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
    ),
}
VARIANT_FAMILY: dict[str, str] = {"cohere2_moe_sigmoid": "cohere2_moe"}
