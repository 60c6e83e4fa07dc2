"""StepFun's decoders, as data.

- step1 (Step1, Step-Audio's language model): Llama's block with num_attention_groups key-value
  heads and no rotation; each head adds -slope * sqrt(query position - key position) to its scaled
  scores, with ALiBi's slopes (PositionSpec.alibi_sqrt).

- step3_text (Step3's text decoder; a step3_vl checkpoint's text_config, its text weights at the
  root and its vision tower never read: config_file.TEXT_WRAPPERS): Llama's block whose query passes
  a bottleneck (model/query_bottleneck.py): self_attn.q_proj narrows the hidden state to
  share_q_dim, the RMS norm self_attn.inter_norm norms it there and self_attn.wq widens it to every
  head, beside num_attention_groups key-value heads (k_proj, v_proj), rotated over the whole head by
  halves. The layers moe_layers_enum lists (a comma-separated string or a list, counted from zero;
  every layer but the first when absent) route by a softmax over moe_num_experts experts (moe.gate),
  the best moe_top_k renormalised under norm_expert_weight, whose projections are stacked one slice
  per expert under moe.gate_proj / moe.up_proj / moe.down_proj, beside the shared expert
  share_expert (share_expert_dim wide); the others keep the dense mlp. Config defaults are vLLM's
  Step3TextConfig's. A config without share_q_dim, or with a moe_layers_enum entry that names no
  layer, is refused; an adapter on query is refused (adapters/targets.py), because q reads the
  bottleneck rather than the hidden state.

- step3p5 (Step 3.5): Llama's block under RMS norms scaled by 1 + weight throughout, per-head query
  and key norms, and each head's output times the sigmoid of its self_attn.g_proj logit
  (use_head_wise_attn_gate). layer_types alternates full and sliding_window attention (vLLM's rule
  without it: the even layers slide); the layers of attention_other_setting's attention_type take
  its num_attention_heads and num_attention_groups, the others num_attention_heads and
  num_attention_groups. Each kind rotates its partial_rotary_factors share by halves at its own base
  from the per-layer rope_theta, rope_scaling only where yarn_only_types lists the kind, and
  use_rope_layers' false entries leave layers unrotated. The layers moe_layers_enum lists route by
  moe_router_activation scores (sigmoid unless stated) that moe.router_bias moves to choose,
  renormalised under norm_expert_weight and scaled by moe_router_scaling_factor, over stacked
  experts (as step3_text's) beside share_expert; swiglu_limits / swiglu_limits_shared clamp the
  routed / shared expert of a layer to min(silu(gate), L) * clamp(up, +-L). Per-layer lists longer
  than num_hidden_layers also cover the multi-token-prediction layers, which are never read. A kind
  whose layers list different rotated shares or bases, rotation scaling on sliding-window layers, a
  clamped dense layer, a second kind with its own head_dim, or use_moe_router_bias false is refused.

ster_dist never runs StepFun's remote code: step1 is checked against the reference written in
tests/families/test_step1_nemotron_nas_k2_horizon.py, the two Step3 against the one in
tests/families/test_step3.py, from seeds/000's description (and step3p5 also against Transformers'
Step-3.7 text model where their configs overlap).
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import EXPERTS, ROUTER_CORRECTION, shared_rules
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    MoESpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
    Stacked,
)

_REFERENCE = "tests/families/test_step3.py"
_STEP1_REFERENCE = "tests/families/test_step1_nemotron_nas_k2_horizon.py"
_LAYER = "model.layers.{i}"
# what vLLM's Step3TextConfig assumes where a config is silent
_DEFAULTS = {
    "num_attention_groups": 1,
    "head_dim": 256,
    "rms_norm_eps": 1e-5,
    "moe_num_experts": 48,
    "moe_top_k": 3,
    "moe_intermediate_size": 5120,
    "share_expert_dim": 5120,
    "norm_expert_weight": False,
    "rope_theta": 500000.0,
    "max_position_embedding": 65536,
}


def _sparse_layers(raw: dict, layers: int, beyond: int = 0) -> set[int]:
    """The layers moe_layers_enum lists; entries naming the `beyond` layers after the decoder's
    (Step 3.5's multi-token-prediction layers) are dropped."""
    listed = raw.get("moe_layers_enum")
    if listed is None:
        return set(range(1, layers))
    items = listed.split(",") if isinstance(listed, str) else listed
    if not isinstance(items, (list, tuple)):
        raise ConfigProblem(
            "moe_layers_enum must be a comma-separated string or a list of layer indices"
        )
    sparse = set()
    for item in items:
        if isinstance(item, str) and not item.strip():
            continue
        try:
            index = int(item.strip() if isinstance(item, str) else item)
        except (TypeError, ValueError):
            index = None
        if isinstance(item, bool) or index is None or not 0 <= index < layers + beyond:
            raise ConfigProblem(
                f"moe_layers_enum entry {item!r} names no layer of the {layers}; list layer "
                f"indices from 0 to {layers - 1}"
            )
        if index < layers:
            sparse.add(index)
    return sparse


def _step3_text(raw: dict) -> dict:
    if raw.get("share_q_dim") is None:
        raise Refusal(
            "invalid model config: share_q_dim is not stated; step3_text's query bottleneck needs its width"
        )
    raw = with_defaults(raw, _DEFAULTS)
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return raw  # the shared reader refuses the layer count itself
    sparse = _sparse_layers(raw, layers)
    out = {k: v for k, v in raw.items() if k not in ("moe_layers_enum", "max_position_embedding")}
    return {
        **out,
        "num_key_value_heads": raw["num_attention_groups"],
        "query_bottleneck": raw["share_q_dim"],
        "max_position_embeddings": raw["max_position_embedding"],
        "norm_topk_prob": raw["norm_expert_weight"],
        "shared_intermediate_size": raw["share_expert_dim"],
        "attention_bias": False,
        "mlp_bias": False,
        "mlp_layer_types": ["sparse" if i in sparse else "dense" for i in range(layers)],
    }


def _layer_kinds(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    sparse = raw.get("mlp_layer_types") or ["dense"] * layers
    return ("bottleneck_attention",) * layers, tuple(
        "moe" if kind == "sparse" else "dense" for kind in sparse
    )


def _per_layer(raw: dict, key: str, layers: int, default=None) -> list:
    """A per-layer list cut to the decoder's layers (Step 3.5's lists go on over its MTP layers), or
    `default`
    for every layer when unstated or empty."""
    value = raw.get(key)
    if value is None or (isinstance(value, list) and not value):
        return [default] * layers
    if not isinstance(value, list):
        return [value] * layers
    if len(value) < layers:
        raise ConfigProblem(
            f"{key} lists {len(value)} values for {layers} layers; list one per layer"
        )
    return list(value[:layers])


def _numbers(raw: dict, key: str, layers: int, default: float, low: float = 0.0) -> list[float]:
    """A per-layer list of numbers of at least `low` (null: `default`)."""
    values = [default if x is None else x for x in _per_layer(raw, key, layers, default)]
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) or x < low for x in values):
        raise ConfigProblem(f"{key} must list a number of at least {low} for each layer")
    return [float(x) for x in values]


def _step3p5_rotations(raw: dict, kinds: list[str], layers: int) -> dict:
    """rope_parameters per kind from the per-layer rope_theta and partial_rotary_factors, each
    kind's layers agreeing; rope_scaling on the kinds yarn_only_types names (every kind when it is
    unstated)."""
    # config_ranges checks each is above zero
    thetas = _per_layer(raw, "rope_theta", layers, 10000.0)
    shares = _numbers(raw, "partial_rotary_factors", layers, 1.0)
    scaling, scaled = (
        raw.get("rope_scaling"),
        raw.get("yarn_only_types") or ["full_attention", "sliding_attention"],
    )
    out = {}
    for kind in dict.fromkeys(kinds):
        stated_pairs = {(thetas[i], shares[i]) for i in range(layers) if kinds[i] == kind}
        if len(stated_pairs) > 1:
            raise ConfigProblem(
                f"the {kind} layers list different rotated shares or bases {sorted(stated_pairs)}; "
                "one rotation per kind of layer is supported"
            )
        ((theta, share),) = stated_pairs
        out[kind] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": share}
        if isinstance(scaling, dict) and kind in scaled:
            if kind == "sliding_attention":
                raise ConfigProblem(
                    "rope_scaling reaches the sliding_attention layers (yarn_only_types); rotation "
                    "scaling on sliding-window layers is not supported"
                )
            out[kind] = {**scaling, "rope_theta": theta, "partial_rotary_factor": share}
    return out


def _step3p5(raw: dict) -> dict:
    raw = with_defaults(
        raw,
        {
            "rms_norm_eps": 1e-5,
            "moe_router_activation": "sigmoid",
            "norm_expert_weight": True,
            "moe_router_scaling_factor": 1.0,
        },
    )
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return raw  # the shared reader refuses the layer count itself
    if raw.get("use_moe_router_bias") is False:
        raise ConfigProblem(
            "use_moe_router_bias is false; Step 3.5's router always chooses with moe.router_bias"
        )
    kinds = (
        _per_layer(raw, "layer_types", layers)
        if raw.get("layer_types")
        else ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    )
    other = raw.get("attention_other_setting") or {}
    heads, groups = (
        raw.get("num_attention_heads"),
        stated(raw, "num_attention_groups", "num_key_value_heads"),
    )
    other_kind = other.get("attention_type", "sliding_attention")
    hidden = raw.get("hidden_size")
    head_dim = raw.get("head_dim") or (
        hidden // heads
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0
        else None
    )
    if other.get("head_dim") is not None and other["head_dim"] != head_dim:
        raise ConfigProblem(
            f"attention_other_setting's head_dim {other['head_dim']} differs from head_dim "
            f"{head_dim}; layers of their own head width are not supported"
        )
    mine = [kind == other_kind for kind in kinds]
    mtp = raw.get("num_nextn_predict_layers")
    sparse = _sparse_layers(
        raw, layers, mtp if isinstance(mtp, int) and not isinstance(mtp, bool) else 0
    )
    limits, shared_limits = (
        _numbers(raw, key, layers, 0.0) for key in ("swiglu_limits", "swiglu_limits_shared")
    )
    for i in range(layers):
        if i not in sparse and (limits[i] or shared_limits[i]):
            raise ConfigProblem(
                f"layer {i} is dense but swiglu_limits or swiglu_limits_shared clamps it; a clamped "
                "dense layer is not supported"
            )
    use_rope = _per_layer(raw, "use_rope_layers", layers, True)
    dropped = (
        "moe_layers_enum",
        "rope_theta",
        "rope_scaling",
        "partial_rotary_factors",
        "partial_rotary_factor",
        "layer_types",
        "swiglu_limits",
        "swiglu_limits_shared",
        "use_rope_layers",
    )
    out = {k: v for k, v in raw.items() if k not in dropped}
    return {
        **out,
        "layer_types": kinds,
        "rope_parameters": _step3p5_rotations(raw, kinds, layers),
        "layer_heads": [other.get("num_attention_heads", heads) if m else heads for m in mine],
        "layer_kv_heads": [
            other.get("num_attention_groups", groups) if m else groups for m in mine
        ],
        "num_key_value_heads": groups,
        "no_rope_layers": [int(bool(u)) for u in use_rope],
        "sigmoid_head_gate": bool(raw.get("use_head_wise_attn_gate", False)),
        "scoring_func": raw["moe_router_activation"],
        "norm_topk_prob": raw["norm_expert_weight"],
        "routed_scaling_factor": raw["moe_router_scaling_factor"],
        "shared_intermediate_size": raw.get("share_expert_dim"),
        "glu_limit_layers": limits,
        "shared_glu_limit_layers": shared_limits,
        "attention_bias": False,
        "mlp_bias": False,
        "mlp_layer_types": ["sparse" if i in sparse else "dense" for i in range(layers)],
    }


# one [experts, rows, columns] tensor per projection, the router and the shared expert
_STACKED_MOE = (
    Rule(f"{_LAYER}.moe.gate.weight", "layers.{i}.mlp.router.weight"),
    *(
        Rule(f"{_LAYER}.moe.{name}_proj.weight", Stacked((f"{EXPERTS}{name}",)))
        for name in ("gate", "up", "down")
    ),
    *shared_rules(f"{_LAYER}.share_expert"),
)

_RULES = (
    llama_rules(q=None, q_norm=None, k_norm=None)
    + (
        Rule(f"{_LAYER}.self_attn.q_proj.weight", "layers.{i}.attn.q_down.weight"),
        Rule(f"{_LAYER}.self_attn.inter_norm.weight", "layers.{i}.attn.q_down_norm.weight"),
        Rule(f"{_LAYER}.self_attn.wq.weight", "layers.{i}.attn.q.weight"),
    )
    + _STACKED_MOE
)
_STEP3P5_RULES = (
    llama_rules()
    + _STACKED_MOE
    + (
        Rule(f"{_LAYER}.self_attn.g_proj.weight", "layers.{i}.attn.gate.weight"),
        Rule(f"{_LAYER}.moe.router_bias", ROUTER_CORRECTION),
    )
)


def _step1(raw: dict) -> dict:
    """num_attention_groups as the key-value head count."""
    groups = raw.get("num_attention_groups")
    return dict(raw) if groups is None else {**raw, "num_key_value_heads": groups}


STEP3_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "step1",
        llama_rules(q_norm=None, k_norm=None),
        positions=PositionSpec(kind="alibi", alibi_sqrt=True),
        normalize=_step1,
        parity_reference=_STEP1_REFERENCE,
    ),
    FamilySpec(
        "step3_text",
        _RULES,
        normalize=_step3_text,
        layer_kinds=_layer_kinds,
        moe=MoESpec(shared="stated"),
        parity_reference=_REFERENCE,
    ),
    FamilySpec(
        "step3p5",
        _STEP3P5_RULES,
        normalize=_step3p5,
        attention=AttentionSpec(qk_norm=QKNormSpec()),
        norms=NormSpec(offset=1.0),
        moe=MoESpec(scoring="sigmoid", shared="stated", correction_bias=True, scaling="always"),
        parity_reference=_REFERENCE,
    ),
)
