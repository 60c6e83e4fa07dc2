"""Tiny checkpoints of ster_dist/families/gptj_neox.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # adjacent pairs rotating over half of each 12-wide head
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_inner=80, rotary_dim=6)),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(rotary_pct=0.5, use_parallel_residual=True),
    ),
    "gpt_neox_seq": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(rotary_pct=0.5, use_parallel_residual=False),
    ),
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(
            num_key_value_heads=2,
            qk_layernorm=True,
            use_qkv_bias=True,
            use_parallel_residual=True,
            partial_rotary_factor=0.5,
        ),
    ),
}
VARIANT_FAMILY: dict[str, str] = {"gpt_neox_seq": "gpt_neox"}
# GPT-J states its feed-forward width as n_inner
UNSTATED_BASE: dict[str, tuple[str, ...]] = {"gptj": ("intermediate_size",)}
