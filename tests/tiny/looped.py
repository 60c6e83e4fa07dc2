"""Tiny checkpoints of ster_dist/families/looped.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # two layers a stack, two high cycles of two low passes and one high: twelve passes' layers; the
    # embedding
    # scale unlike 1 / initializer_range; prompts causal here (tests/families/test_looped.py reads
    # them both ways)
    "hrm_text": (
        "HrmTextConfig",
        "HrmTextForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            H_cycles=2,
            L_cycles=2,
            embedding_scale=7.0,
            prefix_lm=False,
        ),
    ),
}
