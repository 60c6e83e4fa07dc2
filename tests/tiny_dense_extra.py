"""Tiny Transformers checkpoints of the families in ster_dist/families/dense_extra.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

TINY_DENSE_EXTRA: dict[str, tuple[str, str, dict]] = {}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_DENSE_EXTRA: dict[str, str] = {}
