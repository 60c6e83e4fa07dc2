"""Tiny Transformers checkpoints of the families in ster_dist/families/dense_extra.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

TINY_DENSE_EXTRA: dict[str, tuple[str, str, dict]] = {
    # Transformers runs EXAONE 3 as Llama and saves it under EXAONE's own names (transformer.h, c_fc_0, ...)
    "exaone": ("ExaoneConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
    "iquestcoder": ("IQuestCoderConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, attention_bias=True, mlp_bias=True)),
    # post norms over both sublayers, Granite's multipliers, logits multiplied by logits_scaling
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=0.5, mlp_bias=True)),
    "hyperclovax_no_post_norm": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", dict(
        num_key_value_heads=1, use_post_norm=False, logits_scaling=2.0)),
    # sinks; full attention on layers 0 and 4 (unstated layer_types); layer 0 at rope_theta, layer 4 unrotated,
    # sliding layer 1 unrotated and sliding layers 2-3 at their own base
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", dict(
        num_hidden_layers=5, num_key_value_heads=2, sliding_window=4, layer_rope_theta=[10000.0, 0, 500.0, 500.0, 0],
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    # per-head query/key norms, xIELU (its stored numbers perturbed like every 1-d parameter), llama3 rotation
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(num_key_value_heads=2, head_dim=16, attention_bias=True)),
    # biased LayerNorms and projections by default, squared ReLU
    "jais2": ("Jais2Config", "Jais2ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_DENSE_EXTRA: dict[str, str] = {"hyperclovax_no_post_norm": "hyperclovax"}
