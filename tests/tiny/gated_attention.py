"""Tiny checkpoints of ster_dist/families/gated_attention.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # sliding (rotated) layers around an unrotated full-attention one, a window shorter than the prompts, a dense
    # first layer, sigmoid routing with expert_bias, two shared experts, route_scale, mup's embedding scale
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        num_shared_experts=2, route_scale=1.7, global_attn_every_n_layers=2, sliding_window=5, mup_enabled=True)),
}
