"""Tencent's HunYuan families: per-head query/key norms (query_layernorm, key_layernorm) applied after the
rotation, and refusals of cross-layer and latent attention.

- hunyuan_v1_dense: Llama's names with those norms; Transformers always builds them, so unstated is on.
- hunyuan_v1_moe: the same attention over renormalised softmax experts (router under gate.wg) and a shared mlp
  as wide as num_shared_expert x intermediate_size.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules, shared_rules
from ster_dist.families.normalize import defaults, switch, with_defaults
from ster_dist.families.spec import AttentionSpec, FamilySpec, MoESpec, QKNormSpec

_MLP = "model.layers.{i}.mlp"
_QK_NORMS = dict(q_norm="query_layernorm", k_norm="key_layernorm")
_REFUSED = {"use_cla": "cross-layer attention (keys and values shared between layers) is not supported",
            "use_mla": "HunYuan's latent attention is not supported"}

# per-head query/key norms applied after the rotation
_ATTENTION = AttentionSpec(qk_norm=QKNormSpec("head", after_rope=True))


def _hunyuan_v1_dense(raw: dict) -> dict:
    """The query/key norms on unless use_qk_norm says not: Transformers always builds them."""
    raw = with_defaults(raw, {"use_qk_norm": True, "rms_norm_eps": 1e-5})
    return {**raw, "use_qk_norm": switch(raw, "use_qk_norm")}


HUNYUAN_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("hunyuan_v1_dense", llama_rules(**_QK_NORMS), attention=_ATTENTION, normalize=_hunyuan_v1_dense,
               refuse_keys=_REFUSED, parity_reference="HunYuanDenseV1ForCausalLM"),
    FamilySpec("hunyuan_v1_moe", llama_rules(**_QK_NORMS) + expert_rules(_MLP) + router_rules(f"{_MLP}.gate.wg")
               + shared_rules(f"{_MLP}.shared_mlp"),
               attention=_ATTENTION, normalize=defaults({"rms_norm_eps": 1e-5}), refuse_keys=_REFUSED,
               moe=MoESpec(renormalize=True, shared="dense_width"), parity_reference="HunYuanMoEV1ForCausalLM"),
)
