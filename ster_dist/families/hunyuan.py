"""Tencent's HunYuan families: per-head query/key norms (query_layernorm, key_layernorm) applied
after the rotation, and refusals of cross-layer and latent attention.

- hunyuan_v1_dense: Llama's names with those norms; Transformers always builds them, so unstated is
  on.
- hunyuan_v1_moe: the same attention over renormalised softmax experts (router under gate.wg) and a
  shared mlp as wide as num_shared_expert x intermediate_size.
- hy_v3 (Hy3): Llama's block with per-head query/key norms before the rotation (Apertus's
  attention), the layers mlp_layer_types calls sparse routing by sigmoid scores plus mlp.expert_bias
  (to choose only), greedy over all experts, renormalised under route_norm and scaled by
  router_scaling_factor, beside num_shared_experts moe_intermediate_size-wide shared experts under
  mlp.shared_mlp.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import (
    ROUTER_CORRECTION,
    expert_rules,
    router_rules,
    shared_rules,
)
from ster_dist.families.normalize import defaults, stated, switch, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    MoESpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)

_MLP = "model.layers.{i}.mlp"
_QK_NORMS = dict(q_norm="query_layernorm", k_norm="key_layernorm")
_REFUSED = {
    "use_cla": "cross-layer attention (keys and values shared between layers) is not supported",
    "use_mla": "HunYuan's latent attention is not supported",
}

# per-head query/key norms applied after the rotation
_ATTENTION = AttentionSpec(qk_norm=QKNormSpec("head", after_rope=True))


def _hunyuan_v1_dense(raw: dict) -> dict:
    """The query/key norms on unless use_qk_norm says not: Transformers always builds them."""
    raw = with_defaults(raw, {"use_qk_norm": True, "rms_norm_eps": 1e-5})
    return {**raw, "use_qk_norm": switch(raw, "use_qk_norm")}


def _hy_v3(raw: dict) -> dict:
    """HYV3Config's defaults, its router keys under the generic names. Transformers always
    renormalises the chosen weights; Hy3's own code does so under route_norm (true unless
    stated)."""
    raw = with_defaults(
        raw,
        {
            "head_dim": 128,
            "rms_norm_eps": 1e-5,
            "router_scaling_factor": 2.826,
            "num_shared_experts": 1,
            "first_k_dense_replace": 1,
        },
    )
    return {
        **raw,
        "routed_scaling_factor": raw["router_scaling_factor"],
        "norm_topk_prob": bool(stated(raw, "route_norm", default=True)),
    }


# sigmoid scores, a selection bias, greedy over every expert, always scaled, deepseek-wide shared
# experts
_HY_V3_ROUTER = MoESpec(
    scoring="sigmoid", correction_bias=True, scaling="always", shared="deepseek"
)
_HY_V3_RULES = (
    llama_rules()
    + expert_rules(_MLP)
    + router_rules(f"{_MLP}.router.gate")
    + (Rule(f"{_MLP}.expert_bias", ROUTER_CORRECTION),)
    + shared_rules(f"{_MLP}.shared_mlp")
)

HUNYUAN_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "hunyuan_v1_dense",
        llama_rules(**_QK_NORMS),
        attention=_ATTENTION,
        normalize=_hunyuan_v1_dense,
        refuse_keys=_REFUSED,
        parity_reference="HunYuanDenseV1ForCausalLM",
    ),
    FamilySpec(
        "hunyuan_v1_moe",
        llama_rules(**_QK_NORMS)
        + expert_rules(_MLP)
        + router_rules(f"{_MLP}.gate.wg")
        + shared_rules(f"{_MLP}.shared_mlp"),
        attention=_ATTENTION,
        normalize=defaults({"rms_norm_eps": 1e-5}),
        refuse_keys=_REFUSED,
        moe=MoESpec(renormalize=True, shared="dense_width"),
        parity_reference="HunYuanMoEV1ForCausalLM",
    ),
    FamilySpec(
        "hy_v3",
        _HY_V3_RULES,
        attention=AttentionSpec(qk_norm=QKNormSpec("head")),
        positions=PositionSpec(theta=11158840.0),
        normalize=_hy_v3,
        moe=_HY_V3_ROUTER,
        parity_reference="HYV3ForCausalLM",
    ),
)
