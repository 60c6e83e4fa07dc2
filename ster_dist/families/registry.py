"""The registry: family name -> FamilySpec, and each family's status.

Status is derived, never hand-kept: a family with a spec "runs"; one whose
spec names a Transformers reference is "parity-checked" (tests/test_parity.py
compares every such family); every other name of the gate is "refused".
"""

from __future__ import annotations

from ster_dist.families.classic import CLASSIC_FAMILIES
from ster_dist.families.dense import DENSE_FAMILIES
from ster_dist.families.dense_extra import DENSE_EXTRA_FAMILIES
from ster_dist.families.llama_variants import LLAMA_VARIANT_FAMILIES
from ster_dist.families.mistral_format import MISTRAL_FORMAT_FAMILIES
from ster_dist.families.moe import MOE_FAMILIES
from ster_dist.families.moe_extra import MOE_EXTRA_FAMILIES
from ster_dist.families.moe_variants import MOE_VARIANT_FAMILIES
from ster_dist.families.names import FAMILY_NAMES
from ster_dist.families.olmo_glm import OLMO_GLM_FAMILIES
from ster_dist.families.spec import FamilySpec

_ALL = (DENSE_FAMILIES + OLMO_GLM_FAMILIES + LLAMA_VARIANT_FAMILIES + DENSE_EXTRA_FAMILIES + CLASSIC_FAMILIES
        + MOE_FAMILIES + MOE_VARIANT_FAMILIES + MOE_EXTRA_FAMILIES)
SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in _ALL}
assert len(SPECS) == len(_ALL), "a family is specified twice"
assert set(SPECS) <= set(FAMILY_NAMES), set(SPECS) - set(FAMILY_NAMES)
# Name maps of checkpoint formats other than Transformers' (GGUF presents Transformers' names itself)
FORMAT_SPECS: dict[str, dict[str, FamilySpec]] = {"mistral": {spec.name: spec for spec in MISTRAL_FORMAT_FAMILIES}}
assert all(set(specs) <= set(SPECS) for specs in FORMAT_SPECS.values())


def spec_for(family: str, weight_format: str = "safetensors") -> FamilySpec | None:
    """The family's spec for checkpoints in `weight_format` (the Transformers spec unless the format has its own)."""
    return FORMAT_SPECS.get(weight_format, SPECS).get(family)


def status(family: str) -> str:
    spec = SPECS.get(family)
    if spec is None:
        return "refused"
    return "parity-checked" if spec.parity_reference else "runs"


def family_table() -> list[dict]:
    return [{"family": name, "status": status(name),
             "reference": (SPECS[name].parity_reference if name in SPECS else None)} for name in FAMILY_NAMES]
