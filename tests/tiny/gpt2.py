"""Tiny checkpoints of ster_dist/families/gpt2.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=48, n_layer=3, n_head=4, n_positions=128, n_inner=80),
    ),
    # multi-query (one key-value head) and multi-head; n_head is given by its own name, as the
    # config derives
    # num_key_value_heads from it before the attribute map would set it
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_head=4, n_inner=80, multi_query=True),
    ),
    "gpt_bigcode_mha": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_head=4, n_inner=80, multi_query=False, tie_word_embeddings=False),
    ),
}
VARIANT_FAMILY: dict[str, str] = {"gpt_bigcode_mha": "gpt_bigcode"}
# GPT-2 states every size under its own names; GPT-BigCode its width and heads
UNSTATED_BASE: dict[str, tuple[str, ...]] = {
    "gpt2": (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
    ),
    **{v: ("intermediate_size", "num_attention_heads") for v in ("gpt_bigcode", "gpt_bigcode_mha")},
}
