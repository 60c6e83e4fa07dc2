"""Mixture-of-experts families built from conventions the decoder already has (ERNIE 4.5 MoE, Hunyuan MoE, GraniteMoE shared, FlexOlmo, GLM-4.7-Flash).

Each is a neighbour's layout with a few switches: GraniteMoE shared is GraniteMoE plus a fused
shared_mlp (MoESpec.shared "stated"), FlexOlmo is OLMo 2's post-norm block over OLMoE's experts,
GLM-4.7-Flash is DeepSeek-V3's latent attention and router with mlp_layer_types, ERNIE 4.5 MoE
rotates adjacent pairs and keeps its selection bias as [1, experts] (moe_statics), HunYuan norms
each rotated head and runs a shared mlp as wide as the dense one (MoESpec.shared "dense_width").
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.moe import (
    _DEEPSEEK,
    _MLA_BIAS,
    V3_ROUTER,
    _granitemoe_rules,
    expert_rules,
    router_rules,
    shared_rules,
)
from ster_dist.families.spec import FamilySpec, Fused, MoESpec, Rule

_MLP = "model.layers.{i}.mlp"
_SHARED = "layers.{i}.mlp.shared."


def granitemoeshared_rules() -> tuple[Rule, ...]:
    shared = "model.layers.{i}.shared_mlp"
    gate_up = Fused(((f"{_SHARED}gate.weight", "shared_intermediate"), (f"{_SHARED}up.weight", "shared_intermediate")),
                    unit="one")
    return _granitemoe_rules() + (Rule(f"{shared}.input_linear.weight", gate_up),
                                  Rule(f"{shared}.output_linear.weight", f"{_SHARED}down.weight"))


def _flex_olmo_rules() -> tuple[Rule, ...]:
    return (llama_rules(attn_norm=None, mlp_norm=None, post_attn_norm="post_attention_layernorm",
                        post_mlp_norm="post_feedforward_layernorm", gate=None, up=None, down=None)
            + expert_rules(_MLP) + router_rules(f"{_MLP}.gate"))


def _ernie_rules() -> tuple[Rule, ...]:
    shared = tuple(rule for name, target in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
                   for rule in weight_and_bias(f"{_MLP}.shared_experts.{name}", f"{_SHARED}{target}"))
    return (llama_rules(q_norm=None, k_norm=None) + expert_rules(_MLP) + router_rules(f"{_MLP}.gate") + shared
            + (Rule(f"{_MLP}.moe_statics.e_score_correction_bias", "layers.{i}.mlp.router.correction"),))


def _hunyuan_rules() -> tuple[Rule, ...]:
    return (llama_rules(q_norm="query_layernorm", k_norm="key_layernorm") + expert_rules(_MLP)
            + router_rules(f"{_MLP}.gate.wg") + shared_rules(f"{_MLP}.shared_mlp"))


_ERNIE_BIAS = dict(qkv_bias_keys=("use_bias",), o_bias_keys=("use_bias",), mlp_bias_keys=("use_bias",),
                   lm_head_bias_keys=("use_bias",))

MOE_VARIANT_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("granitemoeshared", granitemoeshared_rules(), mlp_bias_keys=(),
               moe=MoESpec(renormalize=True, shared="stated"), parity_reference="GraniteMoeSharedForCausalLM"),
    FamilySpec("flex_olmo", _flex_olmo_rules(), pre_norm=False, post_norm=True, qk_norm="proj", mlp_bias_keys=(),
               moe=MoESpec(), parity_reference="FlexOlmoForCausalLM"),
    FamilySpec("glm4_moe_lite", _DEEPSEEK, latent_attention=True, rope_interleaved=True, **_MLA_BIAS,
               config_defaults={"first_k_dense_replace": 1, "norm_topk_prob": True},
               moe=V3_ROUTER, parity_reference="Glm4MoeLiteForCausalLM"),
    FamilySpec("ernie4_5_moe", _ernie_rules(), rope_interleaved=True, tied_default=True,
               default_rope_theta=500000.0, **_ERNIE_BIAS,
               moe=MoESpec(renormalize=True, correction_bias=True, shared="deepseek"),
               parity_reference="Ernie4_5_MoeForCausalLM"),
    FamilySpec("hunyuan_v1_moe", _hunyuan_rules(), qk_norm="head", qk_norm_after_rope=True, mlp_bias_keys=(),
               config_defaults={"rms_norm_eps": 1e-5},
               refuse_keys={"use_cla": "cross-layer attention (keys and values shared between layers) is not "
                                       "supported",
                            "use_mla": "HunYuan's latent attention is not supported"},
               moe=MoESpec(renormalize=True, shared="dense_width"), parity_reference="HunYuanMoEV1ForCausalLM"),
)
