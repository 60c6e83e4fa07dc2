"""Tiny checkpoints of ster_dist/families/mimo_v2.py's families."""

from __future__ import annotations

# sliding layers (window 5, twice the full layers' two key-value heads, sinks) around two full ones, each kind at
# its own base over a third of each 24-wide head, 16-wide values scaled by 0.6; top-2 of six experts by
# DeepSeek-V3's router after a dense first layer
TINY: dict[str, tuple[str, str, dict]] = {
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=24, v_head_dim=16, sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        attention_value_scale=0.6, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        routed_scaling_factor=1.5, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.334}})),
}
