"""Tiny checkpoints of ster_dist/families/mamba2.py's families: chunk sizes below the test prompts'
lengths, so Transformers' chunked scan carries its state across chunks."""

from __future__ import annotations

_NO_ATTENTION = ("num_attention_heads", "intermediate_size", "max_position_embeddings")

TINY: dict[str, tuple[str, str, dict]] = {
    # two groups of four heads (TP=2 keeps each group whole), biased projections, tied head
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(
            num_heads=8,
            head_dim=12,
            n_groups=2,
            state_size=16,
            conv_kernel=4,
            expand=2,
            chunk_size=16,
            use_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    # one group (TP=2 replicates it and splits its heads), attention in the middle layer rotating
    # half a head
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            num_key_value_heads=2,
            mamba_n_heads=8,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
            attn_layer_indices=[1],
        ),
    ),
}
UNSTATED_BASE = {"mamba2": _NO_ATTENTION}
TINY["nemotron_h"] = (
    "NemotronHConfig",
    "NemotronHForCausalLM",
    dict(
        # every layer kind: Mamba-2, attention without rotation, the plain squared-ReLU feed-forward,
        # and ungated
        # experts routed over two groups of four (one kept), scaled, beside a shared expert of another
        # width
        layers_block_type=["linear_attention", "full_attention", "mlp", "moe", "linear_attention"],
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=12,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=24,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    ),
)
# the experts in a latent width (moe_latent_size) with biased latent projections (mlp_bias), one
# group; Mamba-2
# first as in the published Nemotron 3 patterns (Transformers 5.25 reads a cache's length from its
# first layer)
TINY["nemotron_h_latent"] = (
    "NemotronHConfig",
    "NemotronHForCausalLM",
    dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=12,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=20,
        moe_shared_expert_intermediate_size=24,
        moe_latent_size=32,
        mlp_bias=True,
        routed_scaling_factor=1.5,
    ),
)
VARIANT_FAMILY = {"nemotron_h_latent": "nemotron_h"}
