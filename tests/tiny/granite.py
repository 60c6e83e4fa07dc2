"""Tiny checkpoints of ster_dist/families/granite.py's families."""

from __future__ import annotations

# Granite's four multipliers, away from one so the tests see each
_MULTIPLIERS = dict(
    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0
)

TINY: dict[str, tuple[str, str, dict]] = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(num_key_value_heads=2, **_MULTIPLIERS)),
    # sinks; full attention on layers 0 and 4 (unstated layer_types); layer 0 at rope_theta, layer 4
    # unrotated,
    # sliding layer 1 unrotated and sliding layers 2-3 at their own base
    "granite_swa": (
        "GraniteSWAConfig",
        "GraniteSWAForCausalLM",
        dict(
            num_hidden_layers=5,
            num_key_value_heads=2,
            sliding_window=4,
            layer_rope_theta=[10000.0, 0, 500.0, 500.0, 0],
            **_MULTIPLIERS,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    # post norms over both sublayers, Granite's multipliers, logits multiplied by logits_scaling
    "hyperclovax": (
        "HyperCLOVAXConfig",
        "HyperCLOVAXForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=0.5,
            mlp_bias=True,
        ),
    ),
    "hyperclovax_no_post_norm": (
        "HyperCLOVAXConfig",
        "HyperCLOVAXForCausalLM",
        dict(num_key_value_heads=1, use_post_norm=False, logits_scaling=2.0),
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(
            num_key_value_heads=2,
            num_local_experts=6,
            num_experts_per_tok=2,
            intermediate_size=24,
            **_MULTIPLIERS,
        ),
    ),
    # GraniteMoE's multipliers and experts with a fused shared_mlp beside them
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        dict(
            num_key_value_heads=2,
            num_local_experts=6,
            num_experts_per_tok=2,
            intermediate_size=24,
            shared_intermediate_size=40,
            **_MULTIPLIERS,
        ),
    ),
    # GraniteMoE shared with per-head sinks, sliding layers, and per-layer bases (zero: no rotation)
    "granitemoe_swa": (
        "GraniteMoeSWAConfig",
        "GraniteMoeSWAForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            num_local_experts=6,
            num_experts_per_tok=2,
            intermediate_size=24,
            shared_intermediate_size=40,
            **_MULTIPLIERS,
            sliding_window=5,
            layer_types=[
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            layer_rope_theta=[10000.0, 2000.0, 0, 0],
        ),
    ),
}
# Granite 4.0: Mamba-2 layers (two groups of four heads) around an attention layer, Granite's
# multipliers
_HYBRID = dict(
    num_key_value_heads=2,
    layer_types=["mamba", "attention", "mamba"],
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
    shared_intermediate_size=40,
    **_MULTIPLIERS,
)
# experts beside the shared_mlp, rotating attention
TINY["granitemoehybrid"] = (
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    dict(
        **_HYBRID,
        num_local_experts=6,
        num_experts_per_tok=2,
        intermediate_size=24,
        position_embedding_type="rope",
    ),
)
# no experts: the shared_mlp is the dense feed-forward; attention without positions
TINY["granitemoehybrid_dense"] = (
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    dict(**_HYBRID, num_local_experts=0, position_embedding_type="nope"),
)
VARIANT_FAMILY: dict[str, str] = {
    "hyperclovax_no_post_norm": "hyperclovax",
    "granitemoehybrid_dense": "granitemoehybrid",
}
