"""Tiny checkpoints of ster_dist/families/gemma.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=16)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            sliding_window_pattern=2,
            query_pre_attn_scalar=16,
        ),
    ),
    "vaultgemma": (
        "VaultGemmaConfig",
        "VaultGemmaForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
}
