"""AllenAI's OLMo families, dense and sparse.

- olmo (OLMo 1): LayerNorms with neither scale nor bias at Transformers' fixed epsilon; clip_qkv clamps q, k, v.
- olmo2: no norm before a sublayer, one over each sublayer's output, a norm over the whole query and key
  projections.
- olmo3: OLMo 2 with sliding-window layers (every fourth layer full when layer_types is unstated), a top-level
  rope_scaling kept off the sliding layers as Olmo3Config does.
- olmoe: Llama's pre-norm block with whole-projection query/key norms, over unrenormalised softmax experts.
- flex_olmo: OLMo 2's post-norm block over OLMoE's experts.
"""

from __future__ import annotations

from ster_dist.families.layouts import OLMO2_POST_NORMS, llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules
from ster_dist.families.normalize import defaults
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    MoESpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
)

_MLP = "model.layers.{i}.mlp"
_EXPERTS = expert_rules(_MLP) + router_rules(f"{_MLP}.gate")
# OLMo 2's block: no norm before a sublayer, one over each sublayer's output, whole-projection query/key norms
_POST_NORMS = NormSpec(pre=False, post=True)
_PROJ_QK_NORMS = AttentionSpec(qk_norm=QKNormSpec("proj"))

OLMO_FAMILIES: tuple[FamilySpec, ...] = (
    # OLMo 1: LayerNorms with neither scale nor bias at Transformers' fixed epsilon; clip_qkv clamps q, k, v
    FamilySpec("olmo", llama_rules(attn_norm=None, mlp_norm=None, q_norm=None, k_norm=None),
               norms=NormSpec(kind="layer", affine=False, eps=1e-5), parity_reference="OlmoForCausalLM"),
    FamilySpec("olmo2", llama_rules(**OLMO2_POST_NORMS), norms=_POST_NORMS, attention=_PROJ_QK_NORMS,
               parity_reference="Olmo2ForCausalLM"),
    # OLMo 3: OLMo 2 with sliding-window layers (every fourth layer full when layer_types is unstated)
    FamilySpec("olmo3", llama_rules(**OLMO2_POST_NORMS), norms=_POST_NORMS,
               attention=AttentionSpec(qk_norm=QKNormSpec("proj"), sliding="pattern"),
               positions=PositionSpec(local_unscaled=True, theta=500_000.0),
               normalize=defaults({"sliding_window": 4096, "sliding_window_pattern": 4}),
               parity_reference="Olmo3ForCausalLM"),
    FamilySpec("olmoe", llama_rules() + _EXPERTS, attention=_PROJ_QK_NORMS, moe=MoESpec(),
               parity_reference="OlmoeForCausalLM"),
    FamilySpec("flex_olmo", llama_rules(**OLMO2_POST_NORMS, gate=None, up=None, down=None) + _EXPERTS,
               norms=_POST_NORMS, attention=_PROJ_QK_NORMS, moe=MoESpec(), parity_reference="FlexOlmoForCausalLM"),
)
