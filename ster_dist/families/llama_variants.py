"""Dense families that are Llama's block with a few conventions changed (Nemotron, Arcee, Seed-OSS, ERNIE 4.5, InternLM3, Hunyuan dense, Ministral 3, VaultGemma)."""

from __future__ import annotations

from ster_dist.families.spec import FamilySpec

LLAMA_VARIANT_FAMILIES: tuple[FamilySpec, ...] = ()
