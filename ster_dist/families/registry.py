"""The registry: family name -> FamilySpec, and each family's status.

Status is derived, never hand-kept: a family with a spec "runs"; one whose
spec names a Transformers reference is "parity-checked" (tests/test_parity.py
compares every such family); every other name of the gate is "refused".
"""

from __future__ import annotations

from ster_dist.families.dense import DENSE_FAMILIES
from ster_dist.families.moe import MOE_FAMILIES
from ster_dist.families.names import FAMILY_NAMES
from ster_dist.families.spec import FamilySpec

SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in DENSE_FAMILIES + MOE_FAMILIES}
assert set(SPECS) <= set(FAMILY_NAMES), set(SPECS) - set(FAMILY_NAMES)


def spec_for(family: str) -> FamilySpec | None:
    return SPECS.get(family)


def status(family: str) -> str:
    spec = SPECS.get(family)
    if spec is None:
        return "refused"
    return "parity-checked" if spec.parity_reference else "runs"


def family_table() -> list[dict]:
    return [{"family": name, "status": status(name),
             "reference": (SPECS[name].parity_reference if name in SPECS else None)} for name in FAMILY_NAMES]
