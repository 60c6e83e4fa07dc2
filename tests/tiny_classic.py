"""Tiny Transformers checkpoints of the families in ster_dist/families/classic.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

TINY_CLASSIC: dict[str, tuple[str, str, dict]] = {}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_CLASSIC: dict[str, str] = {}
