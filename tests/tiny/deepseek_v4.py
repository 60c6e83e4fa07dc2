"""Tiny checkpoints of ster_dist/families/deepseek_v4.py's family."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # each attention kind (sliding, compressed sparse at rate 2, heavily compressed at rate 4,
    # sparse again) so
    # windows close inside short prompts; a sliding window of 6 and index_topk 3 below the parity
    # prompts' 40
    # tokens so both bite; YaRN on the compressed layers; a hash-routed first layer
    # (tests/tiny_models.py fills its
    # tid2eid); three streams; a small swiglu_limit so every clamp bites
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            head_dim=16,
            partial_rotary_factor=0.5,
            q_lora_rank=24,
            o_groups=2,
            o_lora_rank=12,
            sliding_window=6,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            index_n_heads=4,
            index_head_dim=8,
            index_topk=3,
            compress_rope_theta=160000.0,
            rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            intermediate_size=16,
            moe_intermediate_size=16,
            routed_scaling_factor=1.5,
            swiglu_limit=0.5,
            hc_mult=3,
            hc_sinkhorn_iters=20,
            rms_norm_eps=1e-6,
        ),
    ),
}
# 4 heads in o_groups 8 (each output group half a head) and n_shared_experts 2 (Transformers still
# builds one
# shared expert): shapes tests/config/test_config_shape_sweep.py found refused
TINY["deepseek_v4_half_head_groups"] = (
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    dict(TINY["deepseek_v4"][2], o_groups=8, n_shared_experts=2),
)
VARIANT_FAMILY = {"deepseek_v4_half_head_groups": "deepseek_v4"}
