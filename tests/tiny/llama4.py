"""Tiny checkpoints of ster_dist/families/llama4.py's families."""

from __future__ import annotations

# four layers: chunks of five positions on the rotating ones (several chunks in the tests'
# sequences), one
# unrotated layer whose query temperature steps every four positions, experts on layers 1 and 3
# (top-2 of six,
# so expert-parallel ranks get uneven loads) beside a shared expert, dense layers wider than the
# experts
TINY: dict[str, tuple[str, str, dict]] = {
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=24,
            intermediate_size_mlp=80,
            num_local_experts=6,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 1, 0, 1],
            attention_chunk_size=5,
            floor_scale=4,
            attn_scale=0.3,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
    ),
}
