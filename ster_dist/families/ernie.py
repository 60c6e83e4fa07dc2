"""Baidu's ERNIE 4.5 families: adjacent pairs rotating, use_bias switching every projection (and,
with experts, the head), a tied head.

- ernie4_5: Llama's names with those conventions.
- ernie4_5_moe: ERNIE 4.5's block over renormalised softmax experts with biased shared experts and a
  selection bias stored as [1, experts] (moe_statics); sparse layers are an index range taken every
  interval.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.moe_layouts import ROUTER_CORRECTION, expert_rules, router_rules
from ster_dist.families.normalize import biases_from, with_defaults
from ster_dist.families.spec import EmbeddingSpec, FamilySpec, MoESpec, PositionSpec, Rule

_MLP = "model.layers.{i}.mlp"
# adjacent pairs rotating, a tied head
_CONVENTIONS = dict(
    positions=PositionSpec(interleaved=True, theta=500000.0), embedding=EmbeddingSpec(tied=True)
)
_ERNIE_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}


def _ernie_moe_rules() -> tuple[Rule, ...]:
    shared = tuple(
        rule
        for name, target in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
        for rule in weight_and_bias(
            f"{_MLP}.shared_experts.{name}", f"layers.{{i}}.mlp.shared.{target}"
        )
    )
    return (
        llama_rules(q_norm=None, k_norm=None)
        + expert_rules(_MLP)
        + router_rules(f"{_MLP}.gate")
        + shared
        + (Rule(f"{_MLP}.moe_statics.e_score_correction_bias", ROUTER_CORRECTION),)
    )


ERNIE_FAMILIES: tuple[FamilySpec, ...] = (
    # use_bias switches every projection
    FamilySpec(
        "ernie4_5",
        llama_rules(q_norm=None, k_norm=None),
        **_CONVENTIONS,
        normalize=lambda raw: biases_from(with_defaults(raw, _ERNIE_DEFAULTS), "use_bias"),
        parity_reference="Ernie4_5ForCausalLM",
    ),
    # use_bias switches every projection and the head
    FamilySpec(
        "ernie4_5_moe",
        _ernie_moe_rules(),
        **_CONVENTIONS,
        normalize=lambda raw: biases_from(raw, "use_bias", head=True),
        moe=MoESpec(renormalize=True, correction_bias=True, shared="deepseek"),
        parity_reference="Ernie4_5_MoeForCausalLM",
    ),
)
