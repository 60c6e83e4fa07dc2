"""Tiny Transformers checkpoints of the families in ster_dist/families/moe_extra.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

TINY_MOE_EXTRA: dict[str, tuple[str, str, dict]] = {
    # Qwen3-MoE with sliding layers from layer_types, a dense first layer from mlp_layer_types, and a YaRN
    # rotation on full-attention layers beside a plain one at another base on sliding layers
    "mellum": ("MellumConfig", "MellumForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                            "rope_theta": 500000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # whole-projection query/key norms, partial rotation, sigmoid scores with a selection bias, renormalised
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=24,
        scoring_func="sigmoid", rotary_dim=8)),
    # GraniteMoE shared with per-head sinks, sliding layers, and per-layer bases (zero: no rotation)
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
        intermediate_size=24, shared_intermediate_size=40, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=4.0, sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        layer_rope_theta=[10000.0, 2000.0, 0, 0])),
    # EXAONE 4's attention (only sliding layers rotate) over DeepSeek-V3's grouped sigmoid router, a shared
    # expert, a dense first layer
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        num_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=1.5, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"])),
    # RMS norms, a dense full-attention first layer that still rotates and is wider, softmax over the chosen
    # experts, a shared expert averaged with the routed ones
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, intermediate_size=24,
        prefix_dense_intermediate_size=80, num_shared_experts=1, rms_norm_eps=1e-5, logit_scale=0.5,
        sliding_window=4, layer_types=["full_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"])),
    # bias-free LayerNorms, biased attention, unrenormalised sigmoid scores, shared experts summed, no rotation
    # on the dense prefix
    "cohere2_moe_sigmoid": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2, intermediate_size=24,
        prefix_dense_intermediate_size=40, num_shared_experts=2, expert_selection_fn="sigmoid", norm_topk_prob=False,
        shared_expert_combination_strategy="sum", prefix_dense_sliding_window_pattern=2, attention_bias=True,
        sliding_window=4, layer_types=["full_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"])),
    # Ling 2.0's block under Sarvam's name, run by Transformers as GLM-4-MoE: per-head query/key norms, full
    # rotation, biased query/key/value, grouped sigmoid routing with a selection bias, a shared expert
    "sarvam_moe": ("SarvamMoEConfig", "Glm4MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.0,
        use_qk_norm=True, attention_bias=True, initializer_range=0.02)),
    # Mixtral's tensors under biased LayerNorms, biased attention and head, SparseMixer with a small jitter, and
    # LongRoPE whose short and long tables (sequences past 32 positions) have their own mscale. The factors are
    # equal: Transformers' PhiMoE rotation recomputes the short table whatever the length.
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, intermediate_size=24,
        router_jitter_noise=0.01, attention_bias=True, lm_head_bias=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                         "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8], "long_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8],
                         "short_mscale": 1.1, "long_mscale": 1.3})),
    # a jitter large enough that SparseMixer's masking changes the weights; no head bias, no attention bias
    "phimoe_jitter": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=24,
        router_jitter_noise=0.5,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                         "short_factor": [1.0] * 6, "long_factor": [1.0] * 6,
                         "short_mscale": 0.9, "long_mscale": 1.2})),
}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_MOE_EXTRA: dict[str, str] = {"cohere2_moe_sigmoid": "cohere2_moe", "phimoe_jitter": "phimoe"}
