"""Further dense families on the shared decoder (EXAONE 3, Apertus, Jais 2, HyperCLOVA X, IQuest-Coder, Granite SWA)."""

from __future__ import annotations

from ster_dist.families.spec import FamilySpec

DENSE_EXTRA_FAMILIES: tuple[FamilySpec, ...] = ()
