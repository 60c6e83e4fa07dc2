"""OLMo 1 and 3, GLM and GLM-4, EXAONE 4, Cohere 2: dense families on the shared decoder."""

from __future__ import annotations

from ster_dist.families.spec import FamilySpec

OLMO_GLM_FAMILIES: tuple[FamilySpec, ...] = ()
