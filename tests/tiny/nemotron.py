"""Tiny checkpoints of ster_dist/families/nemotron.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # LayerNorm1P with bias, squared ReLU plain feed-forward with biases, half of each head rotated
    "nemotron": (
        "NemotronConfig",
        "NemotronForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            mlp_bias=True,
            partial_rotary_factor=0.5,
        ),
    ),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(num_key_value_heads=2, mlp_bias=True)),
    # biased LayerNorms and projections by default, squared ReLU
    "jais2": ("Jais2Config", "Jais2ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
    # per-head query/key norms, xIELU (its stored numbers perturbed like every 1-d parameter),
    # llama3 rotation
    "apertus": (
        "ApertusConfig",
        "ApertusForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, attention_bias=True),
    ),
}
