"""Families whose residual is several hyper-connected streams (model/hyper_connection.py).

- hy_v4 (Tencent's HY V4, Hy4), read as vLLM serves it: DeepSeek-V3's latent attention rotating
  adjacent pairs, a learned sink logit per head (learnable_sink), its output gated elementwise by
  sigmoid(linear_gate(x)) (gated_mla), DeepSeek Sparse Attention whose "shared" layers reuse the
  last indexed layer's choice and whose indexer rotates the last qk_rope_head_dim channels of each
  head by halves; under enable_ihc hc_mult independent hyper-connections (sigmoid pre and post, no
  stream mixing) and hc_head's collapse before the final norm. Dense layers where mlp_layer_types
  says, elsewhere DeepSeek-V3's sigmoid router with a selection bias over stacked SwiGLU experts
  clamped by swiglu_limit, beside shared experts.

  Both spellings of its tensors are read, as Transformers' hy_v4 renames read them: the release's
  (hc_attn_layer.hc_pre.hc_fn, hc_head.hc_head_fn, learnable_sink_param, linear_gate) and those
  Transformers' own writer produces (hc_pre.hc_attn_layer.hc_fn, hc_pre.hc_head.hc_head_fn,
  mlp.linear_gate). The mtp_layers are never mapped.
- glm5_next_text (GLM-5-Next; also the text decoder inside the glm5_next wrapper, below
  model.language_model): hc_mult streams mixed by hyper-connections of the comb form (attn_hc and
  ffn_hc, or the release's hc_attn_fn, hc_attn_base, hc_attn_scale and hc_ffn_*), averaged before
  the final norm. The layers layer_types marks linear_attention run Kimi delta attention
  (model/kimi_delta.py: one conv1d over q, k and v, forget_gate's narrow pair, A_log a number a
  head, the decay bounded under safe_gate); the others latent attention with qk_rope_head_dim 0
  (nothing rotates; positions come from the causal order alone) behind the pooled indexer
  (model/pooled_indexer.py). mlp_layer_types' sparse layers route DeepSeek-V3's way beside shared
  experts; every SwiGLU (dense, shared and routed) is silu(min(gate, swiglu_limit)) * clamp(up,
  +-swiglu_limit).
"""

from __future__ import annotations

from ster_dist.families.deepseek import INDEXER_RULES, latent_rules, sparse_attention_keys
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules, shared_rules
from ster_dist.families.normalize import ConfigProblem
from ster_dist.families.spec import AttentionSpec, FamilySpec, Fused, MoESpec, PositionSpec, Rule

_LAYER = "model.layers.{i}."


def _spellings(target: str, *checkpoints: str) -> tuple[Rule, ...]:
    """One parameter stored under any of several names (a checkpoint holds one of them)."""
    return tuple(Rule(name, target, optional=True) for name in checkpoints)


def _hy_v4_hyper_rules() -> tuple[Rule, ...]:
    rules: list[Rule] = []
    for part in ("fn", "base", "scale"):
        for own, target in (("hc_attn_layer", "attn_hc"), ("hc_mlp_layer", "mlp_hc")):
            rules += _spellings(
                f"layers.{{i}}.{target}.{part}",
                f"{_LAYER}{own}.hc_pre.hc_{part}",
                f"{_LAYER}hc_pre.{own}.hc_{part}",
                f"{_LAYER}{own}.hc_{part}",
            )
        rules += _spellings(
            f"hc_head.{part}",
            f"model.hc_head.hc_head_{part}",
            f"model.hc_pre.hc_head.hc_head_{part}",
            f"model.hc_head.hc_{part}",
        )
    return tuple(rules)


def _gate_spellings(module: str, target: str) -> tuple[Rule, ...]:
    return _spellings(
        target, f"{_LAYER}{module}.linear_gate.weight", f"{_LAYER}{module}.gate_proj.weight"
    )


_HY_V4_RULES = (
    llama_rules(q=None, k=None, v=None, q_norm=None, k_norm=None, gate=None)
    + latent_rules()
    + tuple(Rule(r.checkpoint, r.target, optional=True) for r in INDEXER_RULES)
    + _gate_spellings("mlp", "layers.{i}.mlp.gate.weight")
    + _gate_spellings("mlp.shared_experts", "layers.{i}.mlp.shared.gate.weight")
    + tuple(
        Rule(
            f"{_LAYER}mlp.shared_experts.{name}.weight",
            f"layers.{{i}}.mlp.shared.{name[:-5]}.weight",
        )
        for name in ("up_proj", "down_proj")
    )
    + expert_rules("model.layers.{i}.mlp")
    + router_rules("model.layers.{i}.mlp.gate")
    + _gate_spellings("self_attn", "layers.{i}.attn.gate.weight")
    + _spellings(
        "layers.{i}.attn.sinks.weight",
        f"{_LAYER}self_attn.learnable_sink_param",
        f"{_LAYER}self_attn.sinks",
    )
    + _hy_v4_hyper_rules()
)

# HYV4Config's defaults (and the release's switches) for keys a config leaves out
_HY_V4_DEFAULTS = {
    "enable_ihc": True,
    "gated_mla": True,
    "gating_type": "elementwise",
    "learnable_sink": True,
    "hc_mult": 4,
    "hc_magnitude": 2.0,
    "hc_eps": 1e-6,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 2048,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.827,
    "swiglu_limit": 10.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-5,
    "q_lora_rank": 1536,
    "indexer_rope_interleave": False,
}


def _hy_v4_indexer_types(raw: dict, layers: int) -> list[str]:
    """HYV4Config's: stated, else an indexer on layer 0 and every fourth layer from layer 1."""
    return raw.get("indexer_types") or [
        "full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)
    ]


def _hy_v4(raw: dict) -> dict:
    raw = sparse_attention_keys({**_HY_V4_DEFAULTS, **raw}, {}, _hy_v4_indexer_types)
    if raw["gated_mla"] and raw["gating_type"] != "elementwise":
        raise ConfigProblem(
            f"gating_type {raw['gating_type']!r} is not supported; gated MLA is read with "
            "gating_type elementwise only"
        )
    layers = raw["num_hidden_layers"]
    streams = raw["hc_mult"] if raw["enable_ihc"] else 0
    if raw["enable_ihc"] and (
        isinstance(streams, bool) or not isinstance(streams, int) or streams < 1
    ):
        raise ConfigProblem(f"hc_mult is {streams!r}: state a positive number of residual streams")
    cap = raw.get("soft_logits_capping_logits") if raw.get("soft_logits_capping") else None
    return {
        **raw,
        "mlp_layer_types": raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1),
        "mla_output_gate": bool(raw["gated_mla"]),
        "sink_layers": [bool(raw["learnable_sink"])] * layers,
        "index_rope_tail": True,
        "index_k_norm_eps": raw["rms_norm_eps"],
        "hyper_streams": streams,
        "hyper_mixing": False,
        "hyper_eps": raw["hc_eps"],
        "hyper_post_scale": raw["hc_magnitude"],
        "hyper_post_eps": raw["hc_eps"],
        "hyper_head": "weighted",
        "final_logit_softcapping": cap,
    }


HYPER_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "hy_v4",
        _HY_V4_RULES,
        attention=AttentionSpec(latent=True),
        positions=PositionSpec(interleaved=True),
        normalize=_hy_v4,
        parity_reference="HYV4ForCausalLM",
        ignore=(r"model\.mtp_layers\..*",),
        moe=MoESpec(
            scoring="sigmoid",
            topk_method="noaux_tc",
            scaling="always",
            correction_bias=True,
            shared="deepseek",
            activation="limited_swiglu",
        ),
    ),
)


# GLM-5-Next
# ----------------------------------------------------------------------------------------------------

_ATTN, _MIXER = f"{_LAYER}self_attn", "layers.{i}.mixer"


def _glm5_delta_rules() -> tuple[Rule, ...]:
    """The release's names (as Transformers writes them too), and optionally its in-memory ones:
    forget_gate.* and one conv1d over q, k and v."""
    names = (
        ("q_proj.weight", "q.weight"),
        ("k_proj.weight", "k.weight"),
        ("v_proj.weight", "v.weight"),
        ("b_proj.weight", "b.weight"),
        ("g_a_proj.weight", "g_a.weight"),
        ("g_b_proj.weight", "g_b.weight"),
        ("o_norm.weight", "norm_weight"),
        ("o_proj.weight", "out.weight"),
    )
    gate = (
        ("f_a_proj.weight", "f_a.weight"),
        ("f_b_proj.weight", "f_b.weight"),
        ("A_log", "A_log"),
        ("dt_bias", "dt_bias"),
    )
    # q_proj and o_proj name both kinds' tensors: shard/plan.py picks the rule whose parameter the
    # layer has
    conv = Fused(tuple((f"{_MIXER}.{part}_conv", "linear_key_dim") for part in "qkv"), unit="one")
    return (
        tuple(Rule(f"{_ATTN}.{name}", f"{_MIXER}.{target}") for name, target in names)
        + tuple(
            r
            for name, target in gate
            for r in _spellings(
                f"{_MIXER}.{target}", f"{_ATTN}.{name}", f"{_ATTN}.forget_gate.{name}"
            )
        )
        + tuple(
            r
            for part in "qkv"
            for r in _spellings(f"{_MIXER}.{part}_conv", f"{_ATTN}.{part}_conv1d.weight")
        )
        + (Rule(f"{_ATTN}.conv1d.weight", conv, optional=True),)
    )


def _glm5_hyper_rules() -> tuple[Rule, ...]:
    rules: list[Rule] = []
    for part in ("fn", "base", "scale"):
        for own, release, target in (
            ("attn_hc", "hc_attn", "attn_hc"),
            ("ffn_hc", "hc_ffn", "mlp_hc"),
        ):
            rules += _spellings(
                f"layers.{{i}}.{target}.{part}",
                f"{_LAYER}{own}.{part}",
                f"{_LAYER}{release}_{part}",
            )
    return tuple(rules)


_GLM5_RULES = (
    llama_rules(q=None, k=None, v=None, q_norm=None, k_norm=None)
    + latent_rules()
    + INDEXER_RULES
    + tuple(
        Rule(
            f"{_ATTN}.indexer.index_kpool_compress_{name}",
            f"layers.{{i}}.attn.indexer.compress_{name}.weight",
        )
        for name in ("ape", "gate")
    )
    + _glm5_delta_rules()
    + expert_rules("model.layers.{i}.mlp")
    + router_rules("model.layers.{i}.mlp.gate")
    + shared_rules(f"{_LAYER}mlp.shared_experts")
    + _glm5_hyper_rules()
)

# Glm5NextTextConfig's defaults for keys a config leaves out
_GLM5_DEFAULTS = {
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_kpool": 16,
    "index_kpool_always_select_tail": True,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "swiglu_limit": 10.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-5,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 0,
    "qk_nope_head_dim": 256,
    "v_head_dim": 256,
    "indexer_rope_interleave": False,
    "linear_head_dim": 128,
    "linear_num_heads": 64,
    "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "n_routed_experts": 288,
    "num_experts_per_tok": 8,
}
_GLM5_MIXERS = {
    "linear_attention": "kimi_delta",
    "indexed_attention": "latent_attention",
    "full_attention": "latent_attention",
}


def _glm5_layer_types(raw: dict, layers: int) -> list[str]:
    """Glm5NextTextConfig's: stated, else every fourth layer (from the fourth) latent attention."""
    types = (
        raw.get("glm5_layer_types")
        or raw.get("layer_types")
        or ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    )
    if len(types) != layers or set(types) - set(_GLM5_MIXERS):
        raise ConfigProblem(
            f"layer_types must name linear_attention or indexed_attention for each of the {layers} "
            "layers"
        )
    return list(types)


def _glm5_linear(raw: dict) -> dict:
    """linear_attn_config's sizes under Transformers' names (Glm5NextTextConfig reads them so)."""
    linear = raw.get("linear_attn_config")
    if not isinstance(linear, dict):
        return raw
    out = dict(raw)
    for key, name in (
        ("head_dim", "linear_head_dim"),
        ("num_heads", "linear_num_heads"),
        ("short_conv_kernel_size", "linear_conv_kernel_dim"),
        ("gate_lower_bound", "linear_lower_bound"),
    ):
        if key in linear:
            out[name] = linear[key]
    if linear.get("safe_gate", True) and out.get("linear_lower_bound") is None:
        out["linear_lower_bound"] = -5.0
    return out


def _glm5_next_text(raw: dict) -> dict:
    raw = _glm5_linear(
        {
            **_GLM5_DEFAULTS,
            **{k: v for k, v in raw.items() if v is not None or k == "linear_lower_bound"},
        }
    )
    layers = raw["num_hidden_layers"]
    types = _glm5_layer_types(raw, layers)
    raw = sparse_attention_keys(raw, {}, lambda raw, n: raw.get("indexer_types") or ["full"] * n)
    if "shared" in raw["indexer_types"]:
        raise ConfigProblem(
            "indexer_types marks shared layers; GLM-5-Next's cross-layer top-k sharing is not "
            "supported: state every layer full"
        )
    if raw["qk_rope_head_dim"]:
        raise ConfigProblem(
            f"qk_rope_head_dim is {raw['qk_rope_head_dim']}; GLM-5-Next's latent attention rotates "
            "nothing: state 0"
        )
    streams = raw["hc_mult"]
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ConfigProblem(f"hc_mult is {streams!r}: state a positive number of residual streams")
    heads, width = raw["linear_num_heads"], raw["linear_head_dim"]
    bound = raw["linear_lower_bound"]
    # Transformers writes head_dim as the rotated width, 0
    out = {k: v for k, v in raw.items() if k != "head_dim"}
    return {
        **out,
        "glm5_layer_types": types,
        "mlp_layer_types": raw.get("mlp_layer_types")
        or ["dense"] * min(3, layers) + ["sparse"] * (layers - 3),
        "no_rope_layers": [0] * layers,
        "latent_norm_eps": raw["rms_norm_eps"],
        "kda_a_log_per_head": True,
        "kda_safe_gate": bound is not None,
        "kda_lower_bound": bound,
        # the delta attention's one convolution is read as q, k and v parts of these widths
        # (shard/plan.py)
        "linear_num_key_heads": heads,
        "linear_num_value_heads": heads,
        "linear_key_head_dim": width,
        "linear_value_head_dim": width,
        "glu_limit_inside": raw["swiglu_limit"],
        "hyper_streams": streams,
        "hyper_mixing": True,
        "hyper_eps": raw["hc_eps"],
        "hyper_post_scale": 2.0,
        "hyper_post_eps": 0.0,
        "hyper_sinkhorn_iters": raw["hc_sinkhorn_iters"],
        "hyper_head": "mean",
    }


def _glm5_layer_kinds(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    mixers = tuple(_GLM5_MIXERS[kind] for kind in _glm5_layer_types(raw, layers))
    sparse = raw["mlp_layer_types"]
    if len(sparse) != layers or set(sparse) - {"dense", "sparse"}:
        raise ConfigProblem(
            f"mlp_layer_types must name dense or sparse for each of the {layers} layers"
        )
    return mixers, tuple("moe" if kind == "sparse" else "dense" for kind in sparse)


HYPER_FAMILIES += (
    FamilySpec(
        "glm5_next_text",
        _GLM5_RULES,
        attention=AttentionSpec(latent=True),
        positions=PositionSpec(interleaved=True),
        normalize=_glm5_next_text,
        layer_kinds=_glm5_layer_kinds,
        parity_reference="Glm5NextForConditionalGeneration",
        moe=MoESpec(
            scoring="sigmoid",
            topk_method="noaux_tc",
            scaling="always",
            correction_bias=True,
            shared="deepseek",
            activation="limited_swiglu",
        ),
    ),
)
