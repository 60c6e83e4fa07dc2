"""Xiaomi's MiMo decoders, as data.

- mimo: Qwen2 whose multi-token-prediction layers (model.mtp_layers.{k}: token_layernorm,
  hidden_layernorm, input_proj over [hidden; embedding], a Qwen2 block, final_layernorm, the model's
  lm_head) are recognised and never read for decoding; --speculative mtp drafts with the first
  (model/mtp.py). Checked against Transformers' Qwen2 beside random MTP tensors
  (tests/families/test_telechat_mimo_pangu_nanbeige.py).

- MiMo-V2-Flash: Llama's block whose sliding and full-attention layers differ in key-value heads and
  sinks, over DeepSeek-V3's router.

- mimo_v2_flash: the layers layer_types calls sliding_attention (hybrid_layer_pattern's 1s in
  Xiaomi's own config; Transformers' rule without either: the first and every sixth layer attend
  fully) attend through sliding_window positions (sliding_window_size + 1 where that is stated) with
  swa_num_key_value_heads key-value heads (Transformers: twice num_key_value_heads) and a learned
  sink per head (self_attn.sinks, or attention_sink_bias; on by add_swa_attention_sink_bias, and on
  the full layers by add_full_attention_sink_bias); each kind rotates by its own rope_parameters (or
  rope_theta / swa_rope_theta) over its partial_rotary_factor share (0.334 when unstated), by
  halves. Query and key heads are head_dim wide, value heads v_head_dim, and every value is
  multiplied by attention_value_scale. The layers mlp_layer_types calls sparse (moe_layer_freq's 1s;
  by default all but the first) route by DeepSeek-V3's sigmoid scores with a selection bias
  (mlp.gate.e_score_correction_bias) over n_routed_experts experts, renormalised under
  norm_topk_prob and scaled by routed_scaling_factor, with no shared expert. Its
  multi-token-prediction layers (model.mtp.*) are never read.

- mimo_v2 (MiMo-V2.5): the same model under Xiaomi's own config (layernorm_epsilon for the norms'
  epsilon), whose releases store query, key and value in one self_attn.qkv_proj under
  attention_projection_layout fused_qkv. That tensor is cut into num_key_value_heads groups, as the
  TP=num_key_value_heads ranks Xiaomi's SGLang loader expects: group g holds its share of the query
  heads, then of the layer's key heads, then of its value heads (a sliding layer's twice as many
  key-value heads, two to a group). Both families read either layout.

Sliding layers whose query heads differ in count or width from the full ones
(swa_num_attention_heads, swa_head_dim, swa_v_head_dim) are refused, and so is a fused layout whose
key-value heads do not divide into num_key_value_heads groups, or an attention_projection_layout
other than split or fused_qkv.
"""

from __future__ import annotations

from dataclasses import replace

from ster_dist.families.layouts import ATTENTION_SINKS, llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.qwen import QWEN_FAMILIES
from ster_dist.families.spec import FamilySpec, Fused, MoESpec, MTPSpec, PositionSpec, Rule

_LAYER = "model.layers.{i}"
# what MiMoV2FlashConfig assumes where a config is silent
_DEFAULTS = {
    "head_dim": 192,
    "v_head_dim": 128,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "sliding_window": 129,
    "attention_value_scale": 0.707,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8,
    "n_routed_experts": 256,
}
_SHARE = 0.334  # the rotated share of each head when a rotation states none


def _layer_kinds(raw: dict, layers: int) -> list[str]:
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    pattern = raw.get("hybrid_layer_pattern")
    if pattern is not None:
        if not isinstance(pattern, list) or len(pattern) != layers:
            raise ConfigProblem(
                f"hybrid_layer_pattern must list 0 (full) or 1 (sliding) for each of the {layers} "
                "layers"
            )
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    return [
        "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
        for i in range(layers)
    ]


def _rotations(raw: dict) -> dict:
    """rope_parameters per layer kind, from Xiaomi's rope_theta / swa_rope_theta where not nested
    already."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:
        full, sliding = (
            dict(params["full_attention"] or {}),
            dict(params.get("sliding_attention") or {}),
        )
    else:
        full = {
            "rope_type": "default",
            **params,
            "rope_theta": stated(raw, "rope_theta", default=5_000_000.0),
        }
        sliding = {
            "rope_type": "default",
            "rope_theta": stated(raw, "swa_rope_theta", default=10_000.0),
        }
    share = stated(raw, "partial_rotary_factor", default=_SHARE)
    return {
        "full_attention": {"partial_rotary_factor": share, **full},
        "sliding_attention": {"partial_rotary_factor": share, **sliding},
    }


def _mimo_v2_flash(raw: dict) -> dict:
    if raw.get("rms_norm_eps") is None and raw.get("layernorm_epsilon") is not None:
        raw = {**raw, "rms_norm_eps": raw["layernorm_epsilon"]}  # Xiaomi's own name for it
    raw = with_defaults(raw, _DEFAULTS)
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return raw  # the shared reader refuses the layer count itself
    for key, full in (
        ("swa_num_attention_heads", "num_attention_heads"),
        ("swa_head_dim", "head_dim"),
        ("swa_v_head_dim", "v_head_dim"),
    ):
        if raw.get(key) is not None and raw[key] != raw.get(full):
            raise ConfigProblem(
                f"{key} {raw[key]} differs from {full} {raw.get(full)}; sliding layers with their "
                "own query heads are not supported"
            )
    layout = raw.get("attention_projection_layout")
    if layout not in (None, "split", "separate", "fused_qkv"):
        raise ConfigProblem(
            f"attention_projection_layout {layout!r} is not supported; only split q_proj / k_proj / "
            "v_proj or fused_qkv are"
        )
    kinds = _layer_kinds(raw, layers)
    sliding = [kind == "sliding_attention" for kind in kinds]
    kv = raw["num_key_value_heads"]
    swa_kv = stated(raw, "swa_num_key_value_heads", default=2 * kv if isinstance(kv, int) else kv)
    if (
        layout == "fused_qkv"
        and isinstance(kv, int)
        and isinstance(swa_kv, int)
        and kv > 0
        and (swa_kv % kv or raw.get("num_attention_heads", 0) % kv)
    ):
        raise ConfigProblem(
            f"swa_num_key_value_heads {swa_kv} or num_attention_heads {raw.get('num_attention_heads')} "
            f"does not divide into the fused qkv_proj's {kv} groups (num_key_value_heads)"
        )
    swa_sinks = bool(stated(raw, "add_swa_attention_sink_bias", default=True))
    full_sinks = bool(stated(raw, "add_full_attention_sink_bias", default=False))
    freq = raw.get("moe_layer_freq")
    sparse = raw.get("mlp_layer_types") or (
        ["sparse" if f else "dense" for f in freq]
        if isinstance(freq, list)
        else ["dense"] + ["sparse"] * (layers - 1)
    )
    window = (
        raw["sliding_window_size"] + 1
        if raw.get("sliding_window_size") is not None
        else raw["sliding_window"]
    )
    out = {
        k: v
        for k, v in raw.items()
        if k not in ("rope_theta", "moe_layer_freq", "partial_rotary_factor")
    }
    return {
        **out,
        "layer_types": kinds,
        "sliding_window": window,
        "rope_parameters": _rotations(raw),
        "layer_kv_heads": [swa_kv if s else kv for s in sliding],
        "sink_layers": [int(swa_sinks if s else full_sinks) for s in sliding],
        "value_head_dim": raw["v_head_dim"],
        "mlp_layer_types": sparse,
        "attention_out_bias": False,
        "routed_scaling_factor": stated(raw, "routed_scaling_factor", default=1.0),
    }


def _fused_qkv() -> tuple[Rule, ...]:
    """qkv_proj in num_key_value_heads groups, each its queries, keys and values, counted per layer
    (a sliding layer's key-value heads differ from the full layers') and in rows (values are
    narrower than keys)."""
    parts = (
        ("layers.{i}.attn.q.weight", "layer_query_rows_per_group"),
        ("layers.{i}.attn.k.weight", "layer_key_rows_per_group"),
        ("layers.{i}.attn.v.weight", "layer_value_rows_per_group"),
    )
    bias = tuple((template.replace(".weight", ".bias"), count) for template, count in parts)
    return (
        Rule(f"{_LAYER}.self_attn.qkv_proj.weight", Fused(parts, groups="kv_heads", unit="one")),
        Rule(f"{_LAYER}.self_attn.qkv_proj.bias", Fused(bias, groups="kv_heads", unit="one")),
    )


def _rules() -> tuple[Rule, ...]:
    return (
        llama_rules(q_norm=None, k_norm=None)
        + _fused_qkv()
        + expert_rules(f"{_LAYER}.mlp")
        + router_rules(f"{_LAYER}.mlp.gate")
        + (
            ATTENTION_SINKS,
            Rule(f"{_LAYER}.self_attn.attention_sink_bias", "layers.{i}.attn.sinks.weight"),
        )
    )


_MIMO_V2_FLASH = FamilySpec(
    "mimo_v2_flash",
    _rules(),
    positions=PositionSpec(rotary_share=_SHARE),
    normalize=_mimo_v2_flash,
    moe=MoESpec(scoring="sigmoid", topk_method="noaux_tc", scaling="always", correction_bias=True),
    ignore=(r"model\.mtp\.",),
    parity_reference="MiMoV2FlashForCausalLM",
)

# MiMo-V2.5 is checked against Transformers' MiMo-V2-Flash on its weights unfused
# (tests/tiny/mimo.py)
_MIMO_V2 = replace(_MIMO_V2_FLASH, name="mimo_v2")

# MiMo's MTP layers, as vLLM's mimo_mtp reads them: apart from the decoder's, [h; e] into
# input_proj, the layer
# ending in its final_layernorm, scored by the model's own lm_head
_MIMO_MTP = MTPSpec(
    prefix="model.mtp_layers.{k}.",
    token_norm="token_layernorm",
    hidden_norm="hidden_layernorm",
    proj="input_proj",
    hidden_first=True,
    out_norm="final_layernorm",
    head=None,
    chain_normed=True,
)
# Qwen2 (qwen.py) with model.mtp_layers recognised and read only to draft
_QWEN2 = next(spec for spec in QWEN_FAMILIES if spec.name == "qwen2")
_MIMO = replace(
    _QWEN2,
    name="mimo",
    ignore=(r"model\.mtp_layers\.",),
    parity_reference="tests/families/test_telechat_mimo_pangu_nanbeige.py",
    mtp=_MIMO_MTP,
)
MIMO_FAMILIES: tuple[FamilySpec, ...] = (_MIMO, _MIMO_V2_FLASH, _MIMO_V2)
