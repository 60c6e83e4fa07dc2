"""Older architectures: learned or ALiBi positions, multi-query and parallel attention (GPT-J, GPT-BigCode, OPT, Falcon, BLOOM, MPT)."""

from __future__ import annotations

from ster_dist.families.spec import FamilySpec

CLASSIC_FAMILIES: tuple[FamilySpec, ...] = ()
