"""Tiny checkpoints of ster_dist/families/phi.py's families (PhiMoE's are in mixtral.py)."""

from __future__ import annotations

_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8],
    "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
    "original_max_position_embeddings": 32,
}

TINY: dict[str, tuple[str, str, dict]] = {
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(num_key_value_heads=4, qk_layernorm=True, partial_rotary_factor=0.5),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            num_key_value_heads=2,
            sliding_window=6,
            rope_parameters={**_LONGROPE, "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        ),
    ),
}
