"""Tiny checkpoints of ster_dist/families/mamba.py's families: no attention heads, an odd inner width
(tensor-parallel ranks hold uneven channel shares), a stated time_step_rank beside the "auto" default,
biased projections, tied and untied heads."""

from __future__ import annotations

_MAMBA = dict(state_size=5, conv_kernel=3)

TINY: dict[str, tuple[str, str, dict]] = {
    # inner width 45 x 1: 22 + 23 channels over two ranks; time-step rank "auto", ceil(45 / 16)
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(_MAMBA, hidden_size=45, expand=1)),
    # in_proj and out_proj biased, no convolution bias, a stated time-step rank, its own head
    "mamba_biased": ("MambaConfig", "MambaForCausalLM", dict(_MAMBA, use_bias=True, use_conv_bias=False,
                                                             time_step_rank=5, tie_word_embeddings=False)),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(_MAMBA, mixer_rms_eps=1e-5)),
}
VARIANT_FAMILY: dict[str, str] = {"mamba_biased": "mamba"}
# Mamba's configs take neither attention heads nor a feed-forward width
UNSTATED_BASE: dict[str, tuple[str, ...]] = {v: ("num_attention_heads", "intermediate_size") for v in TINY}
