"""Mixture-of-experts families built from conventions the decoder already has (ERNIE 4.5 MoE, Hunyuan MoE, GraniteMoE shared, FlexOlmo, GLM-4.7-Flash)."""

from __future__ import annotations

from ster_dist.families.spec import FamilySpec

MOE_VARIANT_FAMILIES: tuple[FamilySpec, ...] = ()
