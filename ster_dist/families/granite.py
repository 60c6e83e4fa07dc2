"""IBM's Granite families, dense and sparse, and HyperCLOVA X, which Transformers builds from Granite's classes.
All carry Granite's multipliers (embedding, residual, attention, logits_scaling dividing the logits).

- granite: Llama's block with those multipliers.
- granite_swa: Granite with a learned sink per head (GPT-OSS's), sliding layers (all but the first of each four
  when layer_types is unstated) and layer_rope_theta, where zero leaves a layer unrotated.
- hyperclovax: Granite with a norm over each sublayer's output (use_post_norm) and logits_scaling multiplying.
- granitemoe: Granite's attention over renormalised top-k experts stored stacked (input_linear / output_linear).
- granitemoeshared: GraniteMoE plus a fused shared_mlp as wide as shared_intermediate_size.
- granitemoe_swa: GraniteMoE shared with Granite SWA's sinks, layer_types and layer_rope_theta.
"""

from __future__ import annotations

from ster_dist.families.layouts import ATTENTION_SINKS, llama_rules
from ster_dist.families.moe_layouts import EXPERTS, expert_rules, router_rules
from ster_dist.families.normalize import defaults, stated, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    Fused,
    MoESpec,
    Rule,
    Stacked,
)

_LLAMA = llama_rules(q_norm=None, k_norm=None)
_GRANITE_SWA_DEFAULTS = {"num_key_value_heads": 4, "rms_norm_eps": 1e-5, "sliding_window": 128,
                         "sliding_window_pattern": 4}
_SHARED = "layers.{i}.mlp.shared."


def _granitemoe_rules() -> tuple[Rule, ...]:
    moe = "model.layers.{i}.block_sparse_moe"
    return (llama_rules(q_norm=None, k_norm=None, gate=None, up=None, down=None)
            + (Rule(f"{moe}.input_linear.weight", Stacked((f"{EXPERTS}gate", f"{EXPERTS}up"))),
               Rule(f"{moe}.output_linear.weight", Stacked((f"{EXPERTS}down",))))
            + expert_rules(moe, stacked=moe) + router_rules(f"{moe}.router.layer") + router_rules(f"{moe}.router"))


def _granitemoeshared_rules() -> tuple[Rule, ...]:
    shared = "model.layers.{i}.shared_mlp"
    gate_up = Fused(((f"{_SHARED}gate.weight", "shared_intermediate"), (f"{_SHARED}up.weight", "shared_intermediate")),
                    unit="one")
    return _granitemoe_rules() + (Rule(f"{shared}.input_linear.weight", gate_up),
                                  Rule(f"{shared}.output_linear.weight", f"{_SHARED}down.weight"))


def _hyperclovax(raw: dict) -> dict:
    """The post norms on unless use_post_norm says not; logits_scaling multiplies the logits (Granite's divides),
    so it is read as logit_scale."""
    raw = with_defaults(raw, {"use_post_norm": True})
    if stated(raw, "logits_scaling") is None:
        return raw
    return {**raw, "logit_scale": raw["logits_scaling"], "logits_scaling": None}


# Granite SWA's learned sink per head and sliding layers (all but the first of each four when layer_types is
# unstated); layer_rope_theta's zero leaves a layer unrotated
_SWA = AttentionSpec(sinks=True, sliding="pattern_first")

GRANITE_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("granite", _LLAMA, parity_reference="GraniteForCausalLM"),
    FamilySpec("granite_swa", _LLAMA + (ATTENTION_SINKS,), attention=_SWA, embedding=EmbeddingSpec(tied=True),
               normalize=defaults(_GRANITE_SWA_DEFAULTS), parity_reference="GraniteSWAForCausalLM"),
    # HyperCLOVA X: Granite with a norm over each sublayer's output (use_post_norm) and logits_scaling multiplying
    FamilySpec("hyperclovax", llama_rules(post_attn_norm="post_norm1", post_mlp_norm="post_norm2", q_norm=None,
                                          k_norm=None),
               normalize=_hyperclovax, parity_reference="HyperCLOVAXForCausalLM"),
    FamilySpec("granitemoe", _granitemoe_rules(), moe=MoESpec(renormalize=True),
               parity_reference="GraniteMoeForCausalLM"),
    FamilySpec("granitemoeshared", _granitemoeshared_rules(), moe=MoESpec(renormalize=True, shared="stated"),
               parity_reference="GraniteMoeSharedForCausalLM"),
    FamilySpec("granitemoe_swa", _granitemoeshared_rules() + (ATTENTION_SINKS,), attention=AttentionSpec(sinks=True),
               moe=MoESpec(renormalize=True, shared="stated"), parity_reference="GraniteMoeSWAForCausalLM"),
)
