"""Baidu's ERNIE 4.5 families: adjacent pairs rotating, use_bias switching every projection (and, with
experts, the head), a tied head.

- ernie4_5: Llama's names with those conventions.
- ernie4_5_moe: ERNIE 4.5's block over renormalised softmax experts with biased shared experts and a selection
  bias stored as [1, experts] (moe_statics); sparse layers are an index range taken every interval.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.moe_layouts import ROUTER_CORRECTION, expert_rules, router_rules
from ster_dist.families.spec import FamilySpec, MoESpec, Rule

_MLP = "model.layers.{i}.mlp"
_USE_BIAS = dict(qkv_bias_keys=("use_bias",), o_bias_keys=("use_bias",), mlp_bias_keys=("use_bias",))


def _ernie_moe_rules() -> tuple[Rule, ...]:
    shared = tuple(rule for name, target in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
                   for rule in weight_and_bias(f"{_MLP}.shared_experts.{name}", f"layers.{{i}}.mlp.shared.{target}"))
    return (llama_rules(q_norm=None, k_norm=None) + expert_rules(_MLP) + router_rules(f"{_MLP}.gate") + shared
            + (Rule(f"{_MLP}.moe_statics.e_score_correction_bias", ROUTER_CORRECTION),))


ERNIE_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("ernie4_5", llama_rules(q_norm=None, k_norm=None), rope_interleaved=True, tied_default=True,
               default_rope_theta=500000.0, **_USE_BIAS,
               config_defaults={"head_dim": 128, "num_key_value_heads": 2, "rms_norm_eps": 1e-5},
               parity_reference="Ernie4_5ForCausalLM"),
    FamilySpec("ernie4_5_moe", _ernie_moe_rules(), rope_interleaved=True, tied_default=True,
               default_rope_theta=500000.0, **_USE_BIAS, lm_head_bias_keys=("use_bias",),
               moe=MoESpec(renormalize=True, correction_bias=True, shared="deepseek"),
               parity_reference="Ernie4_5_MoeForCausalLM"),
)
