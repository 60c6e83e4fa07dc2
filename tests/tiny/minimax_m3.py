"""Tiny checkpoints of ster_dist/families/minimax_m3.py's families."""

from __future__ import annotations

# Blocks of four keys, each query keeping three (its own among them), so the parity prompts' 40
# tokens hold
# ten blocks and the choice bites; index heads 12 wide over a rotated share of 8 (half of each
# 16-wide head);
# a dense first layer, then two sparse-attention MoE layers; a small swiglu_limit so the clamps bite
_M3 = dict(
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=6,
    num_experts_per_tok=2,
    intermediate_size=16,
    dense_intermediate_size=24,
    shared_intermediate_size=16,
    routed_scaling_factor=1.5,
    swiglu_limit=1.0,
    moe_layer_freq=[0, 1, 1],
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
)
_SPARSE = dict(
    sparse_attention_freq=[0, 1, 1],
    sparse_num_index_heads=2,
    sparse_index_dim=12,
    sparse_block_size=4,
    sparse_topk_blocks=3,
    sparse_local_block=2,
)
TINY: dict[str, tuple[str, str, dict]] = {
    "minimax_m3_vl_text": (
        "MiniMaxM3VLTextConfig",
        "MiniMaxM3VLForCausalLM",
        dict(_M3, sparse_attention_config=_SPARSE),
    ),
    # 4 index heads over 2 key-value heads: each query head its own choice, as Transformers groups
    # them by index
    # head (tests/config/test_config_shape_sweep.py found it refused)
    "minimax_m3_vl_text_index_heads": (
        "MiniMaxM3VLTextConfig",
        "MiniMaxM3VLForCausalLM",
        dict(_M3, sparse_attention_config=dict(_SPARSE, sparse_num_index_heads=4)),
    ),
}
VARIANT_FAMILY = {"minimax_m3_vl_text_index_heads": "minimax_m3_vl_text"}
