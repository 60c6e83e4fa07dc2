"""Tiny Transformers checkpoints of the families in ster_dist/families/olmo_glm.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]

TINY_OLMO_GLM: dict[str, tuple[str, str, dict]] = {
    # unscaled LayerNorms, clip_qkv tight enough to clamp, biased attention
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(num_key_value_heads=2, clip_qkv=0.15, attention_bias=True)),
    # sliding layers, YaRN on the full layer only
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, sliding_window=4, layer_types=_LAYERS,
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                            "original_max_position_embeddings": 32},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # half of each head rotating by adjacent pairs, biased q/k/v, fused gate_up
    "glm": ("GlmConfig", "GlmForCausalLM", dict(num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.75,
                                                   tie_word_embeddings=True)),
    # sliding layers rotate, the full one does not
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "sliding_attention",
                                                                            "full_attention"])),
    # no sliding window: every layer rotates
    "exaone4_full": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        num_key_value_heads=2, sliding_window=None, layer_types=["full_attention"] * 3)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        num_key_value_heads=2, sliding_window=4, layer_types=_LAYERS, logit_scale=0.5, attention_bias=True)),
}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_OLMO_GLM: dict[str, str] = {"exaone4_full": "exaone4"}
