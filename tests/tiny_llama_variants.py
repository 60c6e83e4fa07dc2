"""Tiny Transformers checkpoints of the families in ster_dist/families/llama_variants.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

TINY_LLAMA_VARIANTS: dict[str, tuple[str, str, dict]] = {
    # LayerNorm1P with bias, squared ReLU plain feed-forward with biases, half of each head rotated
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, attention_bias=True, mlp_bias=True, partial_rotary_factor=0.5)),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(num_key_value_heads=2, mlp_bias=True)),
    # query/key/value biased by attention_bias, the output by attention_out_bias
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, attention_bias=True, attention_out_bias=True, mlp_bias=True)),
    # interleaved rotation, use_bias on every projection, tied head
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(num_key_value_heads=2, head_dim=16, use_bias=True)),
    # query/key norms after the rotation, a fixed alpha-scaled base
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
        rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})),
    # the query temperature switches on past position 8, well inside the tests' sequences
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, sliding_window=6, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.3})),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=20, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0)),
}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_LLAMA_VARIANTS: dict[str, str] = {}
