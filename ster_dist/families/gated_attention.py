"""Families whose attention output is multiplied by a sigmoid gate of the layer's input (the
`attn.gate` rows,
`attn_output_gate`) before the output projection, with Transformers classes of their own.

- afmoe (Arcee Trinity): norms around both sublayers (post_attention_layernorm over attention's
  output, pre_mlp_layernorm / post_mlp_layernorm around the feed-forward), per-head query/key norms,
  the gate from self_attn.gate_proj, and only the sliding-window layers of layer_types rotating
  (written as no_rope_layers). Layers from num_dense_layers route by score_func scores (sigmoid
  unless stated) that mlp.expert_bias moves to choose, renormalised under route_norm when they are
  sigmoids, scaled by route_scale, beside num_shared_experts shared experts; mup_enabled multiplies
  the embedding by sqrt(hidden_size).
- muse_glimmer_text (Muse Glimmer; also the text decoder inside the muse_glimmer wrapper): Gemma 2's
  sandwich block with scales stored as offsets from one and the output norms at post_norm_eps, a
  weightless norm after the embedding, a final norm storing its scale as is, weightless per-head
  query/key norms with the query multiplied (scale_query_by, else qk_scale_factor), the gate from
  self_attn.gate_proj (unless use_attn_output_gate is false), sliding layers per layer_types, a base
  per layer (layer_rope_theta, zero unrotated), and logits times output_multiplier under
  final_logit_softcapping.
"""

from __future__ import annotations

import math

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import (
    ROUTER_CORRECTION,
    expert_rules,
    router_rules,
    shared_rules,
)
from ster_dist.families.normalize import stated, with_defaults
from ster_dist.families.spec import AttentionSpec, FamilySpec, MoESpec, NormSpec, QKNormSpec, Rule

_MLP = "model.layers.{i}.mlp"
_GATE = Rule("model.layers.{i}.self_attn.gate_proj.weight", "layers.{i}.attn.gate.weight")
_UNBIASED_GATE = {
    "attention_bias": (
        False,
        "the output gate has no bias while attention_bias would bias it; "
        "only unbiased attention is supported",
    )
}

_AFMOE_DEFAULTS = {
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "num_dense_layers": 1,
    "num_shared_experts": 2,
    "route_scale": 1.0,
    "sliding_window": 1024,
    "score_func": "sigmoid",
    "route_norm": True,
}


def _afmoe(raw: dict) -> dict:
    """AfmoeConfig's defaults and layer pattern, its router keys under the generic names.
    Transformers' class always scores by sigmoid and renormalises; Arcee's code reads score_func and
    route_norm, which it follows."""
    raw = with_defaults(raw, _AFMOE_DEFAULTS)
    every = int(stated(raw, "global_attn_every_n_layers", default=4))
    kinds = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention"
        for i in range(int(raw["num_hidden_layers"]))
    ]
    scoring = raw["score_func"]
    return {
        **raw,
        "layer_types": kinds,
        "attn_output_gate": True,
        # full-attention layers never rotate, whatever the window
        "no_rope_layers": [int(kind == "sliding_attention") for kind in kinds],
        "first_k_dense_replace": raw["num_dense_layers"],
        "scoring_func": scoring,
        "norm_topk_prob": scoring == "sigmoid" and bool(raw["route_norm"]),
        "routed_scaling_factor": raw["route_scale"],
        "embedding_multiplier": math.sqrt(raw["hidden_size"])
        if stated(raw, "mup_enabled")
        else 1.0,
    }


_AFMOE_RULES = (
    llama_rules(
        mlp_norm="pre_mlp_layernorm",
        post_attn_norm="post_attention_layernorm",
        post_mlp_norm="post_mlp_layernorm",
    )
    + (_GATE,)
    + expert_rules(_MLP)
    + router_rules(f"{_MLP}.router.gate")
    + (Rule(f"{_MLP}.expert_bias", ROUTER_CORRECTION),)
    + shared_rules(f"{_MLP}.shared_experts")
)

_MUSE_DEFAULTS = {
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "post_norm_eps": 1e-8,
    "sliding_window": 2048,
    "final_logit_softcapping": 20.0,
    "qk_scale_factor": 3.87,
    "output_multiplier": 0.19611613513818404,
    "hidden_activation": "silu",
}


def _muse_glimmer_text(raw: dict) -> dict:
    """MuseGlimmerTextConfig's defaults and layer pattern (every fourth layer from the last attends
    fully and unrotated), and the seed's switches Transformers' class lacks (use_qk_norm,
    use_attn_output_gate, scale_query_by). The query multiplier joins the score scale; a
    qk_scale_factor of at least sqrt(head_dim) is the native schema's, which already holds it."""
    raw = with_defaults(raw, _MUSE_DEFAULTS)
    n, root = int(raw["num_hidden_layers"]), math.sqrt(raw["head_dim"])
    full = [(n - 1 - i) % 4 == 0 for i in range(n)]
    theta = stated(
        raw, "rope_theta", default=(raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    )
    qk_norm = bool(stated(raw, "use_qk_norm", default=True))
    out = {
        **raw,
        "use_qk_norm": qk_norm,
        "attn_output_gate": bool(stated(raw, "use_attn_output_gate", default=True)),
        "layer_types": raw.get("layer_types")
        or ["full_attention" if f else "sliding_attention" for f in full],
        "layer_rope_theta": raw.get("layer_rope_theta") or [0 if f else theta for f in full],
        "logit_scale": raw["output_multiplier"],
        "mlp_bias": False,
    }
    if qk_norm:
        multiplier = stated(raw, "scale_query_by")
        if multiplier is None:
            multiplier = raw["qk_scale_factor"]
            multiplier = multiplier / root if multiplier >= root else multiplier
        out["attention_multiplier"] = multiplier / root
    return out


_MUSE_RULES = llama_rules(
    mlp_norm="pre_feedforward_layernorm",
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    q_norm=None,
    k_norm=None,
) + (_GATE,)
# sandwich norms stored as offsets from one, the output ones at post_norm_eps; a weightless norm
# after the
# embedding; a final norm storing its scale as is
_MUSE_NORMS = NormSpec(offset=1.0, post=True, embed=True, embed_affine=False, final_offset=0.0)

GATED_ATTENTION_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "afmoe",
        _AFMOE_RULES,
        attention=AttentionSpec(qk_norm=QKNormSpec("head")),
        norms=NormSpec(post=True),
        normalize=_afmoe,
        require_values=_UNBIASED_GATE,
        moe=MoESpec(correction_bias=True, scaling="always", shared="deepseek"),
        parity_reference="AfmoeForCausalLM",
    ),
    FamilySpec(
        "muse_glimmer_text",
        _MUSE_RULES,
        attention=AttentionSpec(qk_norm=QKNormSpec("head", affine=False)),
        norms=_MUSE_NORMS,
        normalize=_muse_glimmer_text,
        require_values=_UNBIASED_GATE,
        parity_reference="MuseGlimmerForConditionalGeneration",
    ),
)
