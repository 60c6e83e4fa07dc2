"""Laguna (Poolside): Qwen2-MoE's block with per-head query/key norms, a softplus gate per head and
layers that differ in head count, attention kind and rotation.

- laguna: queries and keys are normed per head (q_norm / k_norm) before the rotation; each head's
  output is multiplied by the softplus of its own self_attn.g_proj logit (gating true or "per-head";
  "per-element": one logit per channel). Layer i has num_attention_heads_per_layer[i] query heads
  over num_key_value_heads; its layer_types kind (full_attention, or sliding_attention through
  sliding_window positions) picks its rotation from the per-kind rope_parameters (by default the
  full layers' half share at base 500000, the sliding ones' whole head at 10000), and under
  swa_attention_sink_enabled the sliding layers carry a learned sink per head (self_attn.sink). The
  layers mlp_layer_types calls sparse (by default all but the first) route over num_experts experts
  by sigmoid scores that e_score_correction_bias moves to choose, renormalised and scaled by
  moe_routed_scaling_factor (applied to the experts' input under moe_apply_router_weight_on_input),
  beside mlp.shared_expert, shared_expert_intermediate_size wide.

A router logit cap (moe_router_logit_softcapping) is refused.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import (
    ROUTER_CORRECTION,
    expert_rules,
    router_rules,
    shared_rules,
)
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.spec import AttentionSpec, FamilySpec, MoESpec, QKNormSpec, Rule

_LAYER = "model.layers.{i}"
# what LagunaConfig assumes where a config is silent
_DEFAULTS = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "gating": True,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "moe_routed_scaling_factor": 1.0,
    "moe_apply_router_weight_on_input": False,
    "rope_parameters": {
        "full_attention": {
            "rope_type": "default",
            "rope_theta": 500000.0,
            "partial_rotary_factor": 0.5,
        },
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
        },
    },
}
_GATES = {True: "head", "per-head": "head", "per-element": "element"}


def _laguna(raw: dict) -> dict:
    raw = with_defaults(raw, _DEFAULTS)
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return raw  # the shared reader refuses the layer count itself
    if stated(raw, "moe_router_logit_softcapping", default=0.0):
        raise ConfigProblem(
            f"moe_router_logit_softcapping is {raw['moe_router_logit_softcapping']!r}; a cap on the "
            "router's logits is not supported; set it to 0"
        )
    gate = raw["gating"]
    if gate is not False and gate not in _GATES:
        raise ConfigProblem(
            f'gating is {gate!r}; supported: true, false, "per-head", "per-element"'
        )
    kinds = raw.get("layer_types") or ["full_attention"] * layers
    sinks = bool(stated(raw, "swa_attention_sink_enabled", default=False))
    out = {
        **raw,
        "layer_types": kinds,
        "mlp_layer_types": raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1),
        "softplus_output_gate": _GATES.get(gate, "none"),
        "shared_intermediate_size": raw["shared_expert_intermediate_size"],
        "routed_scaling_factor": raw["moe_routed_scaling_factor"],
    }
    if raw.get("num_attention_heads_per_layer") is not None:
        out["layer_heads"] = raw["num_attention_heads_per_layer"]
    if sinks:
        out["sink_layers"] = [int(kind == "sliding_attention") for kind in kinds]
    return out


def _rules() -> tuple[Rule, ...]:
    mlp = f"{_LAYER}.mlp"
    return (
        llama_rules()
        + expert_rules(mlp)
        + router_rules(f"{mlp}.gate")
        + shared_rules(f"{mlp}.shared_expert")
        + shared_rules(f"{mlp}.shared_experts")
        + (
            Rule(f"{mlp}.experts.e_score_correction_bias", ROUTER_CORRECTION),
            Rule(f"{_LAYER}.self_attn.g_proj.weight", "layers.{i}.attn.gate.weight"),
            Rule(f"{_LAYER}.self_attn.sink", "layers.{i}.attn.sinks.weight"),
        )
    )


LAGUNA_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "laguna",
        _rules(),
        attention=AttentionSpec(qk_norm=QKNormSpec()),
        normalize=_laguna,
        moe=MoESpec(
            scoring="sigmoid",
            renormalize=True,
            scaling="always",
            correction_bias=True,
            shared="stated",
        ),
        parity_reference="LagunaForCausalLM",
    ),
)
