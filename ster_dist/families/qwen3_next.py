"""Qwen3-Next: Qwen3-MoE's block with gated delta-rule linear attention on most layers.

- qwen3_next: every norm stores its scale as an offset from one; full-attention layers (per-head
  query/key norms, a partial rotation) gate their output by the sigmoid of rows q_proj yields after
  each head's query rows; the layers layer_types calls linear_attention (without layer_types, all
  but each full_attention_interval-th) run the gated delta rule (model/gated_delta.py), whose
  in_proj_qkvz and in_proj_ba group rows by key head; the experts are Qwen2-MoE's with a
  sigmoid-gated shared expert. Its multi-token-prediction tensors (mtp.*) are ignored.
- qwen3_5_text: Qwen3-Next's attention and dense feed-forward with the linear attention's
  projections stored apart (in_proj_qkv: every query, then key, then value, as the convolution
  orders them; in_proj_z, in_proj_b, in_proj_a); the output gate follows attn_output_gate (on by
  default); the multimodal rotation sections rotate text as the plain rotation does. Its image-text
  wrapper (qwen3_5) is read as its text decoder (config_file.text_weight_names: below
  model.language_model; the vision tower is skipped).
- qwen3_5_moe_text: qwen3_5_text over Qwen3-Next's experts, renormalised unless norm_topk_prob is
  false (its wrapper qwen3_5_moe likewise).
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules, shared_rules
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    Fused,
    MoESpec,
    NormSpec,
    QKNormSpec,
    Rule,
)

_MIXER = "layers.{i}.mixer"
_MIXERS = {"linear_attention": "gated_delta", "full_attention": "attention"}


def _gated_query(checkpoint: str) -> tuple[Rule, ...]:
    """q_proj: per head, its query rows, then as many output-gate rows."""
    return tuple(
        Rule(
            f"{checkpoint}.{p}",
            Fused(
                ((f"layers.{{i}}.attn.q.{p}", "one"), (f"layers.{{i}}.attn.gate.{p}", "one")),
                groups="heads",
            ),
        )
        for p in ("weight", "bias")
    )


def _delta_rules(linear: str) -> tuple[Rule, ...]:
    """Qwen3-Next's linear_attn: in_proj_qkvz and in_proj_ba hold one group of rows per key head
    (its query and key, then its value heads' values and output gates; its value heads' b, then
    their a)."""
    qkvz = Fused(
        (
            (f"{_MIXER}.q.weight", "linear_key_head_dim"),
            (f"{_MIXER}.k.weight", "linear_key_head_dim"),
            (f"{_MIXER}.v.weight", "linear_value_group"),
            (f"{_MIXER}.z.weight", "linear_value_group"),
        ),
        groups="linear_key_heads",
        unit="one",
    )
    ba = Fused(
        (
            (f"{_MIXER}.b.weight", "linear_values_per_key"),
            (f"{_MIXER}.a.weight", "linear_values_per_key"),
        ),
        groups="linear_key_heads",
        unit="one",
    )
    return (
        Rule(f"{linear}.in_proj_qkvz.weight", qkvz),
        Rule(f"{linear}.in_proj_ba.weight", ba),
    ) + _delta_common(linear)


def _split_delta_rules(linear: str) -> tuple[Rule, ...]:
    """Qwen3.5's linear_attn: in_proj_qkv holds every query, then every key, then every value (the
    convolution's channel order); in_proj_z, in_proj_b and in_proj_a one row per value-head row
    each."""
    qkv = Fused(
        (
            (f"{_MIXER}.q.weight", "linear_key_dim"),
            (f"{_MIXER}.k.weight", "linear_key_dim"),
            (f"{_MIXER}.v.weight", "linear_value_dim"),
        ),
        unit="one",
    )
    return (
        (Rule(f"{linear}.in_proj_qkv.weight", qkv),)
        + tuple(
            Rule(f"{linear}.in_proj_{p}.weight", f"{_MIXER}.{p}.weight") for p in ("z", "b", "a")
        )
        + _delta_common(linear)
    )


def _delta_common(linear: str) -> tuple[Rule, ...]:
    return (
        Rule(f"{linear}.conv1d.weight", f"{_MIXER}.conv_weight"),
        Rule(f"{linear}.A_log", f"{_MIXER}.A_log"),
        Rule(f"{linear}.dt_bias", f"{_MIXER}.dt_bias"),
        Rule(f"{linear}.norm.weight", f"{_MIXER}.norm_weight"),
        Rule(f"{linear}.out_proj.weight", f"{_MIXER}.out.weight"),
    )


def _rules(root: str, delta, sparse: bool) -> tuple[Rule, ...]:
    """The decoder below `root`: gated attention, the linear attention's layout `delta`, and the
    experts where
    `sparse` (beside the dense feed-forward of mlp_only_layers)."""
    layer, mlp = f"{root}layers.{{i}}", f"{root}layers.{{i}}.mlp"
    rules = (
        llama_rules(root=root, q=None)
        + _gated_query(f"{layer}.self_attn.q_proj")
        + delta(f"{layer}.linear_attn")
    )
    if sparse:
        rules += (
            expert_rules(mlp)
            + router_rules(f"{mlp}.gate")
            + shared_rules(f"{mlp}.shared_expert")
            + (Rule(f"{mlp}.shared_expert_gate.weight", "layers.{i}.mlp.shared_gate.weight"),)
        )
    return rules


def _normalize(raw: dict, gate_key: bool = False, renormalize: bool = False) -> dict:
    """Transformers' defaults the shared reader does not know: the attention output gate (always on,
    or where gate_key, on unless attn_output_gate says otherwise), a quarter of each head rotated,
    and (Qwen3.5-MoE) renormalised expert weights unless norm_topk_prob says otherwise."""
    out = dict(raw, mlp_bias=False)  # no feed-forward bias, whatever mlp_bias says
    if not gate_key or out.get("attn_output_gate") is None:
        out["attn_output_gate"] = True
    if out.get("partial_rotary_factor") is None and not (out.get("rope_parameters") or {}).get(
        "partial_rotary_factor"
    ):
        out["partial_rotary_factor"] = 0.25
    if renormalize and out.get("norm_topk_prob") is None:
        out["norm_topk_prob"] = True
    return out


def _layer_kinds(family: str):
    def kinds(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        types = raw.get("layer_types")
        if types is None:
            interval = raw.get("full_attention_interval")
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
                raise Refusal(
                    f"invalid model config: neither layer_types nor a positive full_attention_interval is "
                    f"stated (full_attention_interval is {interval!r}); state which layers attend"
                )
            types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(num_layers)
            ]
        unknown = sorted({str(t) for t in types} - set(_MIXERS))
        if unknown:
            raise Refusal(
                f"invalid model config: layer type {unknown[0]!r} is not supported for {family}; "
                "its layer_types lists linear_attention and full_attention only"
            )
        only = set(raw.get("mlp_only_layers") or [])
        step = int(raw.get("decoder_sparse_step") or 1)
        experts = int(raw.get("num_experts") or 0)
        feed_forwards = tuple(
            "moe" if experts > 0 and i not in only and (i + 1) % step == 0 else "dense"
            for i in range(num_layers)
        )
        return tuple(_MIXERS[t] for t in types), feed_forwards

    return kinds


_COMMON = dict(
    norms=NormSpec(offset=1.0),
    attention=AttentionSpec(qk_norm=QKNormSpec("head")),
    ignore=(r"mtp\..*",),
)
# q_proj is read as query and gate rows (_gated_query); a checkpoint without the gate rows has
# another layout
_GATED = dict(
    require_values={
        "attn_output_gate": (
            True,
            (
                "only the gated attention layout (q_proj holding "
                "each head's query and gate rows) is supported"
            ),
        )
    },
    ignore=(r"mtp\..*",),
)

QWEN3_NEXT_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "qwen3_next",
        _rules("model.", _delta_rules, sparse=True),
        moe=MoESpec(shared="qwen"),
        parity_reference="Qwen3NextForCausalLM",
        normalize=_normalize,
        layer_kinds=_layer_kinds("qwen3_next"),
        **_COMMON,
    ),
    FamilySpec(
        "qwen3_5_text",
        _rules("model.", _split_delta_rules, sparse=False),
        parity_reference="Qwen3_5ForCausalLM",
        normalize=lambda raw: _normalize(raw, gate_key=True),
        layer_kinds=_layer_kinds("qwen3_5_text"),
        **{**_COMMON, **_GATED},
    ),
    FamilySpec(
        "qwen3_5_moe_text",
        _rules("model.", _split_delta_rules, sparse=True),
        moe=MoESpec(shared="qwen"),
        parity_reference="Qwen3_5MoeForCausalLM",
        normalize=lambda raw: _normalize(raw, gate_key=True, renormalize=True),
        layer_kinds=_layer_kinds("qwen3_5_moe_text"),
        **{**_COMMON, **_GATED},
    ),
)
