"""StepFun's Step3 text decoder, as data.

- step3_text (Step3's text decoder; a step3_vl checkpoint's text_config, its text weights at the root and its
  vision tower never read: config_file.TEXT_WRAPPERS): Llama's block whose query passes a bottleneck
  (model/query_bottleneck.py): self_attn.q_proj narrows the hidden state to share_q_dim, the RMS norm
  self_attn.inter_norm norms it there and self_attn.wq widens it to every head, beside num_attention_groups
  key-value heads (k_proj, v_proj), rotated over the whole head by halves. The layers moe_layers_enum lists
  (a comma-separated string or a list, counted from zero; every layer but the first when absent) route by a
  softmax over moe_num_experts experts (moe.gate), the best moe_top_k renormalised under norm_expert_weight,
  whose projections are stacked one slice per expert under moe.gate_proj / moe.up_proj / moe.down_proj, beside
  the shared expert share_expert (share_expert_dim wide); the others keep the dense mlp. Config defaults are
  vLLM's Step3TextConfig's. A config without share_q_dim, or with a moe_layers_enum entry that names no layer,
  is refused; an adapter on query is refused (adapters/targets.py), because q reads the bottleneck rather than
  the hidden state.

ster_dist never runs StepFun's remote code: the family is checked against the reference written in
tests/test_step3.py from seeds/000's description.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import EXPERTS, shared_rules
from ster_dist.families.normalize import ConfigProblem, with_defaults
from ster_dist.families.spec import FamilySpec, MoESpec, Rule, Stacked

_REFERENCE = "tests/test_step3.py"
_LAYER = "model.layers.{i}"
# what vLLM's Step3TextConfig assumes where a config is silent
_DEFAULTS = {
    "num_attention_groups": 1, "head_dim": 256, "rms_norm_eps": 1e-5, "moe_num_experts": 48, "moe_top_k": 3,
    "moe_intermediate_size": 5120, "share_expert_dim": 5120, "norm_expert_weight": False, "rope_theta": 500000.0,
    "max_position_embedding": 65536,
}


def _sparse_layers(raw: dict, layers: int) -> set[int]:
    listed = raw.get("moe_layers_enum")
    if listed is None:
        return set(range(1, layers))
    items = listed.split(",") if isinstance(listed, str) else listed
    if not isinstance(items, (list, tuple)):
        raise ConfigProblem("moe_layers_enum must be a comma-separated string or a list of layer indices")
    sparse = set()
    for item in items:
        if isinstance(item, str) and not item.strip():
            continue
        try:
            index = int(item.strip() if isinstance(item, str) else item)
        except (TypeError, ValueError):
            index = None
        if isinstance(item, bool) or index is None or not 0 <= index < layers:
            raise ConfigProblem(f"moe_layers_enum entry {item!r} names no layer of the {layers}; list layer "
                                f"indices from 0 to {layers - 1}")
        sparse.add(index)
    return sparse


def _step3_text(raw: dict) -> dict:
    if raw.get("share_q_dim") is None:
        raise Refusal("invalid model config: share_q_dim is not stated; step3_text's query bottleneck needs its width")
    raw = with_defaults(raw, _DEFAULTS)
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return raw  # the shared reader refuses the layer count itself
    sparse = _sparse_layers(raw, layers)
    out = {k: v for k, v in raw.items() if k not in ("moe_layers_enum", "max_position_embedding")}
    return {**out, "num_key_value_heads": raw["num_attention_groups"], "query_bottleneck": raw["share_q_dim"],
            "max_position_embeddings": raw["max_position_embedding"], "norm_topk_prob": raw["norm_expert_weight"],
            "shared_intermediate_size": raw["share_expert_dim"], "attention_bias": False, "mlp_bias": False,
            "mlp_layer_types": ["sparse" if i in sparse else "dense" for i in range(layers)]}


def _layer_kinds(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    sparse = raw.get("mlp_layer_types") or ["dense"] * layers
    return ("bottleneck_attention",) * layers, tuple("moe" if kind == "sparse" else "dense" for kind in sparse)


_RULES = (
    llama_rules(q=None, q_norm=None, k_norm=None)
    + (Rule(f"{_LAYER}.self_attn.q_proj.weight", "layers.{i}.attn.q_down.weight"),
       Rule(f"{_LAYER}.self_attn.inter_norm.weight", "layers.{i}.attn.q_down_norm.weight"),
       Rule(f"{_LAYER}.self_attn.wq.weight", "layers.{i}.attn.q.weight"),
       Rule(f"{_LAYER}.moe.gate.weight", "layers.{i}.mlp.router.weight"))
    # one [experts, rows, columns] tensor per projection
    + tuple(Rule(f"{_LAYER}.moe.{name}_proj.weight", Stacked((f"{EXPERTS}{name}",))) for name in ("gate", "up", "down"))
    + shared_rules(f"{_LAYER}.share_expert")
)

STEP3_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("step3_text", _RULES, normalize=_step3_text, layer_kinds=_layer_kinds, moe=MoESpec(shared="stated"),
               parity_reference=_REFERENCE),
)
