"""Tiny checkpoints of ster_dist/families/laguna.py's families."""

from __future__ import annotations

# full layers (YaRN over half of each head) around sliding ones (window 5, the whole head rotated)
# with twice
# their query heads; top-2 of six experts, scaled, beside a shared expert after a dense first layer
_LAGUNA = dict(
    num_hidden_layers=4,
    num_attention_heads_per_layer=[4, 8, 8, 4],
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=5,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
    moe_routed_scaling_factor=1.5,
    rope_parameters={
        "full_attention": {
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "partial_rotary_factor": 0.5,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
)

TINY: dict[str, tuple[str, str, dict]] = {
    "laguna": ("LagunaConfig", "LagunaForCausalLM", _LAGUNA),
    # one gate per channel rather than per head
    "laguna_per_element": (
        "LagunaConfig",
        "LagunaForCausalLM",
        dict(_LAGUNA, gating="per-element"),
    ),
}
VARIANT_FAMILY: dict[str, str] = {"laguna_per_element": "laguna"}
