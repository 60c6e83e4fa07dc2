"""Tiny checkpoints of ster_dist/families/mamba.py's families: no attention heads, an odd inner
width (tensor-parallel ranks hold uneven channel shares), a stated time_step_rank beside the "auto"
default, biased projections, tied and untied heads; a Jamba of Mamba, attention and expert
layers."""

from __future__ import annotations

_MAMBA = dict(state_size=5, conv_kernel=3)

TINY: dict[str, tuple[str, str, dict]] = {
    # inner width 45 x 1: 22 + 23 channels over two ranks; time-step rank "auto", ceil(45 / 16)
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(_MAMBA, hidden_size=45, expand=1)),
    # in_proj and out_proj biased, no convolution bias, a stated time-step rank, its own head
    "mamba_biased": (
        "MambaConfig",
        "MambaForCausalLM",
        dict(
            _MAMBA, use_bias=True, use_conv_bias=False, time_step_rank=5, tie_word_embeddings=False
        ),
    ),
    "falcon_mamba": (
        "FalconMambaConfig",
        "FalconMambaForCausalLM",
        dict(_MAMBA, mixer_rms_eps=1e-5),
    ),
    # an inner width stated on its own, 37, not expand x hidden_size (96): Transformers builds the
    # mixer at the
    # stated width (tests/config/test_config_shape_sweep.py found it read as 96)
    "mamba_stated_width": ("MambaConfig", "MambaForCausalLM", dict(_MAMBA, intermediate_size=37)),
    "falcon_mamba_stated_width": (
        "FalconMambaConfig",
        "FalconMambaForCausalLM",
        dict(_MAMBA, mixer_rms_eps=1e-5, intermediate_size=37, tie_word_embeddings=False),
    ),
    # four layers: Mamba, attention, Mamba, Mamba; experts on layers 1 and 3 (attention over
    # experts, Mamba
    # over experts), dense elsewhere; two key-value heads, biased Mamba projections (widths stay
    # multiples of
    # four: Transformers' grouped expert matmul needs 16-byte strides)
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            num_key_value_heads=2,
            num_hidden_layers=4,
            intermediate_size=24,
            attn_layer_period=3,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=6,
            num_experts_per_tok=2,
            mamba_d_state=5,
            mamba_d_conv=3,
            mamba_expand=3,
            mamba_proj_bias=True,
        ),
    ),
}
VARIANT_FAMILY: dict[str, str] = {
    "mamba_biased": "mamba",
    "mamba_stated_width": "mamba",
    "falcon_mamba_stated_width": "falcon_mamba",
}
# Mamba's configs take neither attention heads nor a feed-forward width
UNSTATED_BASE: dict[str, tuple[str, ...]] = {
    v: ("num_attention_heads", "intermediate_size")
    for v in TINY
    if v != "jamba" and not v.endswith("_stated_width")
}
UNSTATED_BASE.update({v: ("num_attention_heads",) for v in TINY if v.endswith("_stated_width")})
