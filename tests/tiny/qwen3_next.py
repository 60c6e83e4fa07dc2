"""Tiny checkpoints of ster_dist/families/qwen3_next.py's families."""

from __future__ import annotations

from tests.tiny_tokenizer import TINY_VOCAB_SIZE

TINY: dict[str, tuple[str, str, dict]] = {
    # linear attention around one full-attention layer; two value heads per key head (so
    # tensor-parallel
    # ranks split key-head groups), key and value widths unlike each other and the attention
    # head_dim;
    # a dense first layer before the experts
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[0],
        ),
    ),
}
TINY.update(
    {
        # the projections stored apart; attention layers first and last, so both sorts meet the cache at
        # once
        "qwen3_5_text": (
            "Qwen3_5TextConfig",
            "Qwen3_5ForCausalLM",
            dict(
                num_key_value_heads=2,
                head_dim=16,
                layer_types=[
                    "full_attention",
                    "linear_attention",
                    "linear_attention",
                    "full_attention",
                ],
                num_hidden_layers=4,
                linear_num_key_heads=2,
                linear_num_value_heads=6,
                linear_key_head_dim=8,
                linear_value_head_dim=10,
                linear_conv_kernel_dim=3,
                tie_word_embeddings=True,
            ),
        ),
        "qwen3_5_moe_text": (
            "Qwen3_5MoeTextConfig",
            "Qwen3_5MoeForCausalLM",
            dict(
                num_key_value_heads=2,
                head_dim=16,
                layer_types=["linear_attention", "linear_attention", "full_attention"],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=8,
                linear_value_head_dim=12,
                linear_conv_kernel_dim=4,
                num_experts=6,
                num_experts_per_tok=2,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=40,
            ),
        ),
    }
)
UNSTATED_BASE = {"qwen3_5_moe_text": ("intermediate_size",)}

# Qwen3.5's image-text wrapper: the text decoder below model.language_model, beside a one-block
# vision tower
_WRAPPED_TEXT = dict(
    vocab_size=TINY_VOCAB_SIZE + 1,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TINY["qwen3_5"] = (
    "Qwen3_5Config",
    "Qwen3_5ForConditionalGeneration",
    dict(
        text_config=_WRAPPED_TEXT,
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=48,
            patch_size=2,
            temporal_patch_size=1,
            spatial_merge_size=1,
        ),
    ),
)
VARIANT_FAMILY = {"qwen3_5": "qwen3_5_text"}
UNSTATED_BASE["qwen3_5"] = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)
