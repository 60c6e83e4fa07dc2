"""Tiny Transformers checkpoints of the families in ster_dist/families/llama_variants.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

TINY_LLAMA_VARIANTS: dict[str, tuple[str, str, dict]] = {}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_LLAMA_VARIANTS: dict[str, str] = {}
