"""Further mixture-of-experts families (Mellum, MiniMax-M2, GraniteMoE SWA, Cohere 2 MoE, Sarvam MoE, EXAONE MoE)."""

from __future__ import annotations

from ster_dist.families.spec import FamilySpec

MOE_EXTRA_FAMILIES: tuple[FamilySpec, ...] = ()
