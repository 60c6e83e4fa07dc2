"""Tiny checkpoints of ster_dist/families/gemma3n.py's families."""

from __future__ import annotations

# Four layers: sliding, full, then two sharing the keys and values of the last sliding and full
# ones; a window
# shorter than the prompts; three AltUp copies; a sparse gate on the first two layers only
TINY: dict[str, tuple[str, str, dict]] = {
    "gemma3n_text": (
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            num_kv_shared_layers=2,
            activation_sparsity_pattern=[0.95, 0.5, 0.0, 0.0],
            altup_num_inputs=3,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=40,
            laurel_rank=6,
            final_logit_softcapping=5.0,
            intermediate_size=80,
        ),
    ),
}
