"""Tiny checkpoints of ster_dist/families/falcon_h1.py: every muP multiplier unlike one (and unlike
the others), chunk sizes below the test prompts' lengths so Transformers' chunked scan carries its
state across chunks."""

from __future__ import annotations

_MULTIPLIERS = dict(
    embedding_multiplier=1.7,
    lm_head_multiplier=0.6,
    key_multiplier=0.8,
    attention_in_multiplier=0.9,
    attention_out_multiplier=1.3,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.7,
    ssm_multipliers=[0.9, 1.1, 1.3, 0.8, 1.2],
    mlp_multipliers=[1.4, 0.75],
)

TINY: dict[str, tuple[str, str, dict]] = {
    # Transformers' defaults for the mixer's options: no gated norm, unbiased projections; two
    # groups of four
    # heads (TP=2 keeps each group whole), a scan width (mamba_d_ssm) unlike expand x hidden,
    # head_dim unlike
    # hidden / heads
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            mamba_d_ssm=96,
            mamba_n_heads=8,
            mamba_d_head="auto",
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            **_MULTIPLIERS,
        ),
    ),
    # the gated norm before the gate, one group (TP=2 replicates it and splits its heads), in_proj
    # and out_proj
    # biased apart (projectors_bias without mamba_proj_bias), a tied head
    "falcon_h1_normed": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            num_key_value_heads=2,
            mamba_d_ssm=None,
            mamba_expand=2,
            mamba_n_heads=8,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            projectors_bias=True,
            mamba_proj_bias=False,
            tie_word_embeddings=True,
            **_MULTIPLIERS,
        ),
    ),
}
VARIANT_FAMILY = {"falcon_h1_normed": "falcon_h1"}
