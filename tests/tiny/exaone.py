"""Tiny checkpoints of ster_dist/families/exaone.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # Transformers runs EXAONE 3 as Llama and saves it under EXAONE's own names (transformer.h,
    # c_fc_0, ...)
    "exaone": (
        "ExaoneConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
        ),
    ),
    # sliding layers rotate, the full one does not
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    # no sliding window: every layer rotates
    "exaone4_full": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(num_key_value_heads=2, sliding_window=None, layer_types=["full_attention"] * 3),
    ),
    # EXAONE 4's attention (only sliding layers rotate) over DeepSeek-V3's grouped sigmoid router, a
    # shared
    # expert, a dense first layer
    "exaone_moe": (
        "ExaoneMoeConfig",
        "ExaoneMoeForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
    ),
}
VARIANT_FAMILY: dict[str, str] = {"exaone4_full": "exaone4"}
