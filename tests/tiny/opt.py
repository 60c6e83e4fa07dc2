"""Tiny checkpoints of ster_dist/families/opt.py's family."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=80)),
}
# OPT states its feed-forward width as ffn_dim
UNSTATED_BASE: dict[str, tuple[str, ...]] = {"opt": ("intermediate_size",)}
