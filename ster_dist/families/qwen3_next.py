"""Qwen3-Next: Qwen3-MoE's block with gated delta-rule linear attention on most layers.

- qwen3_next: every norm stores its scale as an offset from one; full-attention layers (per-head
  query/key norms, a partial rotation) gate their output by the sigmoid of rows q_proj yields after
  each head's query rows; the layers layer_types calls linear_attention (without layer_types, all but
  each full_attention_interval-th) run the gated delta rule (model/gated_delta.py), whose in_proj_qkvz
  and in_proj_ba group rows by key head; the experts are Qwen2-MoE's with a sigmoid-gated shared expert.
  Its multi-token-prediction tensors (mtp.*) are ignored.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules, shared_rules
from ster_dist.families.spec import FamilySpec, Fused, MoESpec, Rule

_MLP = "model.layers.{i}.mlp"
_LINEAR = "model.layers.{i}.linear_attn"
_MIXER = "layers.{i}.mixer"
_MIXERS = {"linear_attention": "gated_delta", "full_attention": "attention"}


def _gated_query(checkpoint: str) -> tuple[Rule, ...]:
    """q_proj: per head, its query rows, then as many output-gate rows."""
    return tuple(Rule(f"{checkpoint}.{p}", Fused(((f"layers.{{i}}.attn.q.{p}", "one"),
                                                 (f"layers.{{i}}.attn.gate.{p}", "one")), groups="heads"))
                 for p in ("weight", "bias"))


def _delta_rules() -> tuple[Rule, ...]:
    """linear_attn's tensors; in_proj_qkvz and in_proj_ba hold one group of rows per key head (its query and key,
    then its value heads' values and output gates; its value heads' b, then their a)."""
    qkvz = Fused(((f"{_MIXER}.q.weight", "linear_key_head_dim"), (f"{_MIXER}.k.weight", "linear_key_head_dim"),
                  (f"{_MIXER}.v.weight", "linear_value_group"), (f"{_MIXER}.z.weight", "linear_value_group")),
                 groups="linear_key_heads", unit="one")
    ba = Fused(((f"{_MIXER}.b.weight", "linear_values_per_key"), (f"{_MIXER}.a.weight", "linear_values_per_key")),
               groups="linear_key_heads", unit="one")
    return (Rule(f"{_LINEAR}.in_proj_qkvz.weight", qkvz), Rule(f"{_LINEAR}.in_proj_ba.weight", ba),
            Rule(f"{_LINEAR}.conv1d.weight", f"{_MIXER}.conv_weight"),
            Rule(f"{_LINEAR}.A_log", f"{_MIXER}.A_log"), Rule(f"{_LINEAR}.dt_bias", f"{_MIXER}.dt_bias"),
            Rule(f"{_LINEAR}.norm.weight", f"{_MIXER}.norm_weight"),
            Rule(f"{_LINEAR}.out_proj.weight", f"{_MIXER}.out.weight"))


def _normalize(raw: dict) -> dict:
    out = dict(raw)
    out["attn_output_gate"] = True
    # Transformers rotates a quarter of each head unless the config says otherwise
    if out.get("partial_rotary_factor") is None and not (out.get("rope_parameters") or {}).get("partial_rotary_factor"):
        out["partial_rotary_factor"] = 0.25
    return out


def _layer_kinds(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    types = raw.get("layer_types")
    if types is None:
        interval = raw.get("full_attention_interval")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise Refusal(f"invalid model config: neither layer_types nor a positive full_attention_interval is "
                          f"stated (full_attention_interval is {interval!r}); state which layers attend")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    unknown = sorted({str(t) for t in types} - set(_MIXERS))
    if unknown:
        raise Refusal(f"invalid model config: layer type {unknown[0]!r} is not supported for qwen3_next; "
                      "its layer_types lists linear_attention and full_attention only")
    only = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    experts = int(raw.get("num_experts") or 0)
    feed_forwards = tuple("moe" if experts > 0 and i not in only and (i + 1) % step == 0 else "dense"
                          for i in range(num_layers))
    return tuple(_MIXERS[t] for t in types), feed_forwards


QWEN3_NEXT_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("qwen3_next", llama_rules(q=None) + _gated_query("model.layers.{i}.self_attn.q_proj") + _delta_rules()
               + expert_rules(_MLP) + router_rules(f"{_MLP}.gate") + shared_rules(f"{_MLP}.shared_expert")
               + (Rule(f"{_MLP}.shared_expert_gate.weight", "layers.{i}.mlp.shared_gate.weight"),),
               norm_offset=1.0, qk_norm="head", mlp_bias_keys=(), ignore=(r"mtp\..*",),
               moe=MoESpec(shared="qwen"), parity_reference="Qwen3NextForCausalLM",
               normalize=_normalize, layer_kinds=_layer_kinds),
)
