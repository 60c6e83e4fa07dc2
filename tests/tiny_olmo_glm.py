"""Tiny Transformers checkpoints of the families in ster_dist/families/olmo_glm.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

TINY_OLMO_GLM: dict[str, tuple[str, str, dict]] = {}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_OLMO_GLM: dict[str, str] = {}
