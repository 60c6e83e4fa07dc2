"""Tiny checkpoints of ster_dist/families/olmo.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # unscaled LayerNorms, clip_qkv tight enough to clamp, biased attention
    "olmo": (
        "OlmoConfig",
        "OlmoForCausalLM",
        dict(num_key_value_heads=2, clip_qkv=0.15, attention_bias=True),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2)),
    # sliding layers, YaRN on the full layer only
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 500000.0,
                    "original_max_position_embeddings": 32,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=2,
            intermediate_size=24,
            clip_qkv=1.5,
        ),
    ),
    # OLMo 2's post-norms and whole-projection query/key norms over unrenormalised softmax routing
    "flex_olmo": (
        "FlexOlmoConfig",
        "FlexOlmoForCausalLM",
        dict(num_key_value_heads=2, num_experts=7, num_experts_per_tok=2, intermediate_size=24),
    ),
    # linear attention around one rotated attention layer; two value heads per key head, key and
    # value widths
    # unlike each other (as many value as key channels: Transformers saves its joined convolution as
    # three
    # equal q/k/v_conv1d parts); write strengths up to two
    "olmo_hybrid": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(
            num_key_value_heads=2,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=12,
            linear_value_head_dim=6,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}
