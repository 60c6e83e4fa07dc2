"""Families whose residual is several hyper-connected streams (model/hyper_connection.py).

- hy_v4 (Tencent's HY V4, Hy4), read as vLLM serves it: DeepSeek-V3's latent attention rotating adjacent pairs,
  a learned sink logit per head (learnable_sink), its output gated elementwise by sigmoid(linear_gate(x))
  (gated_mla), DeepSeek Sparse Attention whose "shared" layers reuse the last indexed layer's choice and whose
  indexer rotates the last qk_rope_head_dim channels of each head by halves; under enable_ihc hc_mult
  independent hyper-connections (sigmoid pre and post, no stream mixing) and hc_head's collapse before the
  final norm. Dense layers where mlp_layer_types says, elsewhere DeepSeek-V3's sigmoid router with a selection
  bias over stacked SwiGLU experts clamped by swiglu_limit, beside shared experts.

  Both spellings of its tensors are read, as Transformers' hy_v4 renames read them: the release's
  (hc_attn_layer.hc_pre.hc_fn, hc_head.hc_head_fn, learnable_sink_param, linear_gate) and those Transformers'
  own writer produces (hc_pre.hc_attn_layer.hc_fn, hc_pre.hc_head.hc_head_fn, mlp.linear_gate). The mtp_layers
  are never mapped.
"""

from __future__ import annotations

from ster_dist.families.deepseek import INDEXER_RULES, latent_rules, sparse_attention_keys
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules
from ster_dist.families.normalize import ConfigProblem
from ster_dist.families.spec import AttentionSpec, FamilySpec, MoESpec, PositionSpec, Rule

_LAYER = "model.layers.{i}."


def _spellings(target: str, *checkpoints: str) -> tuple[Rule, ...]:
    """One parameter stored under any of several names (a checkpoint holds one of them)."""
    return tuple(Rule(name, target, optional=True) for name in checkpoints)


def _hy_v4_hyper_rules() -> tuple[Rule, ...]:
    rules: list[Rule] = []
    for part in ("fn", "base", "scale"):
        for own, target in (("hc_attn_layer", "attn_hc"), ("hc_mlp_layer", "mlp_hc")):
            rules += _spellings(f"layers.{{i}}.{target}.{part}", f"{_LAYER}{own}.hc_pre.hc_{part}",
                                f"{_LAYER}hc_pre.{own}.hc_{part}", f"{_LAYER}{own}.hc_{part}")
        rules += _spellings(f"hc_head.{part}", f"model.hc_head.hc_head_{part}",
                            f"model.hc_pre.hc_head.hc_head_{part}", f"model.hc_head.hc_{part}")
    return tuple(rules)


def _gate_spellings(module: str, target: str) -> tuple[Rule, ...]:
    return _spellings(target, f"{_LAYER}{module}.linear_gate.weight", f"{_LAYER}{module}.gate_proj.weight")


_HY_V4_RULES = (
    llama_rules(q=None, k=None, v=None, q_norm=None, k_norm=None, gate=None) + latent_rules()
    + tuple(Rule(r.checkpoint, r.target, optional=True) for r in INDEXER_RULES)
    + _gate_spellings("mlp", "layers.{i}.mlp.gate.weight")
    + _gate_spellings("mlp.shared_experts", "layers.{i}.mlp.shared.gate.weight")
    + tuple(Rule(f"{_LAYER}mlp.shared_experts.{name}.weight", f"layers.{{i}}.mlp.shared.{name[:-5]}.weight")
            for name in ("up_proj", "down_proj"))
    + expert_rules("model.layers.{i}.mlp") + router_rules("model.layers.{i}.mlp.gate")
    + _gate_spellings("self_attn", "layers.{i}.attn.gate.weight")
    + _spellings("layers.{i}.attn.sinks.weight", f"{_LAYER}self_attn.learnable_sink_param",
                 f"{_LAYER}self_attn.sinks")
    + _hy_v4_hyper_rules())

# HYV4Config's defaults (and the release's switches) for keys a config leaves out
_HY_V4_DEFAULTS = {"enable_ihc": True, "gated_mla": True, "gating_type": "elementwise", "learnable_sink": True,
                   "hc_mult": 4, "hc_magnitude": 2.0, "hc_eps": 1e-6, "index_n_heads": 16, "index_head_dim": 128,
                   "index_topk": 2048, "n_shared_experts": 1, "routed_scaling_factor": 2.827, "swiglu_limit": 10.0,
                   "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-5,
                   "q_lora_rank": 1536, "indexer_rope_interleave": False}


def _hy_v4_indexer_types(raw: dict, layers: int) -> list[str]:
    """HYV4Config's: stated, else an indexer on layer 0 and every fourth layer from layer 1."""
    return raw.get("indexer_types") or ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)]


def _hy_v4(raw: dict) -> dict:
    raw = sparse_attention_keys({**_HY_V4_DEFAULTS, **raw}, {}, _hy_v4_indexer_types)
    if raw["gated_mla"] and raw["gating_type"] != "elementwise":
        raise ConfigProblem(f"gating_type {raw['gating_type']!r} is not supported; gated MLA is read with "
                            "gating_type elementwise only")
    layers = raw["num_hidden_layers"]
    streams = raw["hc_mult"] if raw["enable_ihc"] else 0
    if raw["enable_ihc"] and (isinstance(streams, bool) or not isinstance(streams, int) or streams < 1):
        raise ConfigProblem(f"hc_mult is {streams!r}: state a positive number of residual streams")
    cap = raw.get("soft_logits_capping_logits") if raw.get("soft_logits_capping") else None
    return {**raw, "mlp_layer_types": raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1),
            "mla_output_gate": bool(raw["gated_mla"]),
            "sink_layers": [bool(raw["learnable_sink"])] * layers,
            "index_rope_tail": True, "index_k_norm_eps": raw["rms_norm_eps"],
            "hyper_streams": streams, "hyper_mixing": False, "hyper_eps": raw["hc_eps"],
            "hyper_post_scale": raw["hc_magnitude"], "hyper_post_eps": raw["hc_eps"], "hyper_head": "weighted",
            "final_logit_softcapping": cap}


HYPER_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("hy_v4", _HY_V4_RULES, attention=AttentionSpec(latent=True), positions=PositionSpec(interleaved=True),
               normalize=_hy_v4, parity_reference="HYV4ForCausalLM", ignore=(r"model\.mtp_layers\..*",),
               moe=MoESpec(scoring="sigmoid", topk_method="noaux_tc", scaling="always", correction_bias=True,
                           shared="deepseek", activation="limited_swiglu")),
)
