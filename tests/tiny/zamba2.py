"""Tiny checkpoints of ster_dist/families/zamba2.py: two shared blocks over three hybrid layers (the
third ties to the first, and its adapter slot is stored under the first's block), one Mamba-2 group
per two heads (TP=2 keeps each group whole), and a Mamba-2 chunk below the test prompts' lengths."""

from __future__ import annotations

_SHARED = dict(
    layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
    num_hidden_layers=5,
    n_mamba_heads=4,
    mamba_ngroups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    chunk_size=16,
    num_mem_blocks=2,
    adapter_rank=6,
    intermediate_size=56,
)

TINY: dict[str, tuple[str, str, dict]] = {
    # rotation, attention adapters, untied head, biased projections
    "zamba2": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            _SHARED,
            use_mem_rope=True,
            use_shared_attention_adapter=True,
            add_bias_linear=True,
            tie_word_embeddings=False,
        ),
    ),
    # no rotation, feed-forward adapters only, grouped key-value heads, tied head
    "zamba2_plain": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            _SHARED, use_mem_rope=False, use_shared_attention_adapter=False, num_key_value_heads=2
        ),
    ),
}
VARIANT_FAMILY = {"zamba2_plain": "zamba2"}
