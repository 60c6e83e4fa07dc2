"""Tiny checkpoints of ster_dist/families/mixtral.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=24,
            sliding_window=6,
        ),
    ),
    # Mixtral's tensors under biased LayerNorms, biased attention and head, SparseMixer with a small
    # jitter, and
    # LongRoPE whose short and long tables (sequences past 32 positions) have their own mscale. The
    # factors are
    # equal: Transformers' PhiMoE rotation recomputes the short table whatever the length.
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(
            num_key_value_heads=2,
            num_local_experts=6,
            num_experts_per_tok=2,
            intermediate_size=24,
            router_jitter_noise=0.01,
            attention_bias=True,
            lm_head_bias=True,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 32,
                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8],
                "long_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8],
                "short_mscale": 1.1,
                "long_mscale": 1.3,
            },
        ),
    ),
    # a jitter large enough that SparseMixer's masking changes the weights; no head bias, no
    # attention bias
    "phimoe_jitter": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=24,
            router_jitter_noise=0.5,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 32,
                "short_factor": [1.0] * 6,
                "long_factor": [1.0] * 6,
                "short_mscale": 0.9,
                "long_mscale": 1.2,
            },
        ),
    ),
    # whole-projection query/key norms, partial rotation, sigmoid scores with a selection bias,
    # renormalised
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=24,
            scoring_func="sigmoid",
            rotary_dim=8,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=6,
            num_experts_per_tok=2,
            intermediate_size=24,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            swiglu_limit=0.1,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 32,
                "truncate": False,
                "rope_theta": 10000.0,
            },
        ),
    ),
}
VARIANT_FAMILY: dict[str, str] = {"phimoe_jitter": "phimoe"}
