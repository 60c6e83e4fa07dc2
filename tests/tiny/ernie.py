"""Tiny checkpoints of ster_dist/families/ernie.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # interleaved rotation, use_bias on every projection, tied head
    "ernie4_5": (
        "Ernie4_5Config",
        "Ernie4_5ForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, use_bias=True),
    ),
    # biases everywhere, adjacent-pair rotation, a selection bias, shared experts, a dense first
    # layer
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            use_bias=True,
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=16,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=-1,
            moe_layer_interval=1,
        ),
    ),
}
