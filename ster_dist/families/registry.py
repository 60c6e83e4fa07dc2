"""The registry: family name -> FamilySpec, and each family's status.

Status is derived, never hand-kept: a family with a spec "runs"; one whose
spec names a Transformers reference is "parity-checked" (tests/families/test_parity.py
compares every such family); every other name of the gate is "refused".
"""

from __future__ import annotations

from ster_dist.families.bloom_falcon import BLOOM_FALCON_FAMILIES
from ster_dist.families.chatglm import CHATGLM_FAMILIES
from ster_dist.families.cohere import COHERE_FAMILIES
from ster_dist.families.deepseek import DEEPSEEK_FAMILIES
from ster_dist.families.deepseek_v4 import DEEPSEEK_V4_FAMILIES
from ster_dist.families.ernie import ERNIE_FAMILIES
from ster_dist.families.exaone import EXAONE_FAMILIES
from ster_dist.families.falcon_h1 import FALCON_H1_FAMILIES
from ster_dist.families.gated_attention import GATED_ATTENTION_FAMILIES
from ster_dist.families.gemma import GEMMA_FAMILIES
from ster_dist.families.gemma4 import GEMMA4_FAMILIES
from ster_dist.families.gemma3n import GEMMA3N_FAMILIES
from ster_dist.families.glm import GLM_FAMILIES
from ster_dist.families.gpt2 import GPT2_FAMILIES
from ster_dist.families.gptj_neox import GPTJ_NEOX_FAMILIES
from ster_dist.families.granite import GRANITE_FAMILIES
from ster_dist.families.hunyuan import HUNYUAN_FAMILIES
from ster_dist.families.hyper import HYPER_FAMILIES
from ster_dist.families.inkling import INKLING_FAMILIES
from ster_dist.families.internlm import INTERNLM_FAMILIES
from ster_dist.families.kimi import KIMI_FAMILIES
from ster_dist.families.laguna import LAGUNA_FAMILIES
from ster_dist.families.lfm2 import LFM2_FAMILIES
from ster_dist.families.longcat import LONGCAT_FAMILIES
from ster_dist.families.llama import LLAMA_FAMILIES
from ster_dist.families.ling import LING_FAMILIES
from ster_dist.families.llama4 import LLAMA4_FAMILIES
from ster_dist.families.looped import LOOPED_FAMILIES
from ster_dist.families.mamba import MAMBA_FAMILIES
from ster_dist.families.mamba2 import MAMBA2_FAMILIES
from ster_dist.families.k2_horizon import K2_HORIZON_FAMILIES
from ster_dist.families.mimo import MIMO_FAMILIES
from ster_dist.families.minimax import MINIMAX_FAMILIES
from ster_dist.families.minimax_m3 import MINIMAX_M3_FAMILIES
from ster_dist.families.mistral_format import MISTRAL_FORMAT_FAMILIES
from ster_dist.families.mixtral import MIXTRAL_FAMILIES
from ster_dist.families.mpt import MPT_FAMILIES
from ster_dist.families.names import FAMILY_NAMES
from ster_dist.families.nemotron import NEMOTRON_FAMILIES
from ster_dist.families.olmo import OLMO_FAMILIES
from ster_dist.families.opt import OPT_FAMILIES
from ster_dist.families.pangu import PANGU_FAMILIES
from ster_dist.families.phi import PHI_FAMILIES
from ster_dist.families.plamo import PLAMO_FAMILIES
from ster_dist.families.qwen import QWEN_FAMILIES
from ster_dist.families.qwen3_next import QWEN3_NEXT_FAMILIES
from ster_dist.families.sparse_attention import SPARSE_ATTENTION_FAMILIES
from ster_dist.families.spec import FamilySpec
from ster_dist.families.step3 import STEP3_FAMILIES
from ster_dist.families.telechat import TELECHAT_FAMILIES
from ster_dist.families.zamba2 import ZAMBA2_FAMILIES

# one module per lineage (the Transformers classes a family is built from); see each module's
# docstring
_ALL = (
    LLAMA_FAMILIES
    + NEMOTRON_FAMILIES
    + GEMMA_FAMILIES
    + QWEN_FAMILIES
    + MIXTRAL_FAMILIES
    + DEEPSEEK_FAMILIES
    + PHI_FAMILIES
    + OLMO_FAMILIES
    + GLM_FAMILIES
    + COHERE_FAMILIES
    + GRANITE_FAMILIES
    + EXAONE_FAMILIES
    + ERNIE_FAMILIES
    + HUNYUAN_FAMILIES
    + GPT2_FAMILIES
    + GPTJ_NEOX_FAMILIES
    + BLOOM_FALCON_FAMILIES
    + MPT_FAMILIES
    + OPT_FAMILIES
    + LFM2_FAMILIES
    + MAMBA_FAMILIES
    + MAMBA2_FAMILIES
    + QWEN3_NEXT_FAMILIES
    + KIMI_FAMILIES
    + ZAMBA2_FAMILIES
    + MINIMAX_FAMILIES
    + FALCON_H1_FAMILIES
    + INTERNLM_FAMILIES
    + TELECHAT_FAMILIES
    + PANGU_FAMILIES
    + PLAMO_FAMILIES
    + CHATGLM_FAMILIES
    + LLAMA4_FAMILIES
    + MIMO_FAMILIES
    + LAGUNA_FAMILIES
    + GATED_ATTENTION_FAMILIES
    + INKLING_FAMILIES
    + LING_FAMILIES
    + LONGCAT_FAMILIES
    + GEMMA3N_FAMILIES
    + HYPER_FAMILIES
    + LOOPED_FAMILIES
    + SPARSE_ATTENTION_FAMILIES
    + STEP3_FAMILIES
    + K2_HORIZON_FAMILIES
    + MINIMAX_M3_FAMILIES
    + GEMMA4_FAMILIES
    + DEEPSEEK_V4_FAMILIES
)
SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in _ALL}
assert len(SPECS) == len(_ALL), "a family is specified twice"
assert set(SPECS) <= set(FAMILY_NAMES), set(SPECS) - set(FAMILY_NAMES)
# Name maps of checkpoint formats other than Transformers' (GGUF presents Transformers' names
# itself)
FORMAT_SPECS: dict[str, dict[str, FamilySpec]] = {
    "mistral": {spec.name: spec for spec in MISTRAL_FORMAT_FAMILIES}
}
assert all(set(specs) <= set(SPECS) for specs in FORMAT_SPECS.values())


def spec_for(family: str, weight_format: str = "safetensors") -> FamilySpec | None:
    """The family's spec for checkpoints in `weight_format` (the Transformers spec unless the format
    has its own)."""
    return FORMAT_SPECS.get(weight_format, SPECS).get(family)


def status(family: str) -> str:
    spec = SPECS.get(family)
    if spec is None:
        return "refused"
    return "parity-checked" if spec.parity_reference else "runs"


def family_table() -> list[dict]:
    return [
        {
            "family": name,
            "status": status(name),
            "reference": (SPECS[name].parity_reference if name in SPECS else None),
        }
        for name in FAMILY_NAMES
    ]
