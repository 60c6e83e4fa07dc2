"""Tiny checkpoints of ster_dist/families/lfm2.py's families."""

from __future__ import annotations

# short convolutions around one attention layer; the feed-forward width derived from
# intermediate_size
# (2/3 of it, times the multiplier, rounded up to block_multiple_of: 80 -> 53 -> 79 -> 84)
_LAYERS = dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"])

TINY: dict[str, tuple[str, str, dict]] = {
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            **_LAYERS,
            num_key_value_heads=2,
            conv_L_cache=3,
            block_multiple_of=12,
            block_ffn_dim_multiplier=1.5,
        ),
    ),
    # a wider kernel, biased convolutions and an untied head, the feed-forward width as stated
    "lfm2_biased": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            **_LAYERS,
            num_key_value_heads=1,
            conv_L_cache=4,
            conv_bias=True,
            block_auto_adjust_ff_dim=False,
            tie_word_embeddings=False,
        ),
    ),
    # one dense layer, then experts chosen by sigmoid scores with a selection bias
    "lfm2_moe": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            **_LAYERS,
            num_key_value_heads=2,
            num_dense_layers=1,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            routed_scaling_factor=1.5,
        ),
    ),
}
VARIANT_FAMILY: dict[str, str] = {"lfm2_biased": "lfm2"}
