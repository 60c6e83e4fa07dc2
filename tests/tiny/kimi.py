"""Tiny checkpoints of ster_dist/families/kimi.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # delta attention around one unrotated latent-attention layer (no query rank, as Kimi-Linear);
    # two delta
    # heads (so tensor-parallel ranks hold one each) of a width unlike the latent heads'; a dense
    # first layer
    # before grouped, renormalised, scaled experts with a shared expert
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=12,
            v_head_dim=10,
            linear_attn_config=dict(
                kda_layers=[1, 3],
                full_attn_layers=[2],
                num_heads=2,
                head_dim=12,
                short_conv_kernel_size=4,
            ),
            mla_use_nope=True,
            num_experts=6,
            num_experts_per_token=2,
            moe_intermediate_size=24,
            num_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            moe_router_activation_func="sigmoid",
        ),
    ),
}
# Ling 3.0: delta attention (fused conv, full-rank bounded forget gate and output gate) in the first
# two layers
# of each group of three, gated latent attention in the last; four delta heads of a width unlike the
# latent
# heads' (two per tensor-parallel rank); a dense first layer before grouped, renormalised, scaled
# experts
TINY["bailing_hybrid"] = (
    "BailingHybridConfig",
    "BailingHybridForCausalLM",
    dict(
        num_hidden_layers=4,
        layer_group_size=3,
        head_dim=12,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        num_experts=6,
        num_experts_per_token=2,
        moe_intermediate_size=24,
        num_shared_experts=1,
        num_expert_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        num_mtp_layers=0,
    ),
)
