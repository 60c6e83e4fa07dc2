"""MiniMax-Text-01: lightning attention beside softmax attention, over Mixtral's experts, each
sublayer weighed against its residual.

- minimax (Transformers' MiniMax): the layers layer_types calls linear_attention run lightning
  attention (model/lightning.py; self_attn.qkv_proj, output_gate, norm, out_proj), the
  full_attention ones Llama's attention (q/k/v/o_proj, rotating whole heads at rope_theta); without
  layer_types every second layer from the second is linear, as MiniMaxConfig fills it. Every layer's
  feed-forward is Mixtral's experts: a softmax router, top num_experts_per_tok renormalised, stored
  under mlp (Transformers 5's stacked experts) or block_sparse_moe (experts.{e}.w1/w3/w2). Each
  sublayer joins the residual as residual * alpha + output * beta, the residual its normed input
  (Transformers' decoder layer always reads it so), with the alpha and beta of linear_attn_*_factor
  or full_attn_*_factor, then mlp_*_factor. The slope and decay buffers Transformers saves are
  recomputed, not read.
- minimax_text_01 (MiniMax's own release of the same model): attn_type_list marks each layer 0
  (lightning) or 1 (softmax attention), the factors are layernorm_linear_attention_*,
  layernorm_full_attention_* and layernorm_mlp_*, and the residual is the normed input only under
  postnorm.
Attention in both rotates rotary_dim of each head where the config states it (MiniMax-Text-01 states
64 of 128), as MiniMax's own code and vLLM do; Transformers' MiniMax ignores rotary_dim and rotates
whole heads, so the two agree only where rotary_dim is the head width (as in the tiny parity
checkpoints). Shared experts (shared_intermediate_size above zero) and a sliding window are refused;
adapters are refused for both (families/adapter_rules.py).
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules
from ster_dist.families.normalize import never_biased, with_defaults
from ster_dist.families.spec import FamilySpec, MoESpec, PositionSpec, Rule

_ATTN, _MIXER = "model.layers.{i}.self_attn", "layers.{i}.mixer"
_MLP, _SPARSE = "model.layers.{i}.mlp", "model.layers.{i}.block_sparse_moe"
_KINDS = {"linear_attention": "lightning", "full_attention": "attention"}


def _rules() -> tuple[Rule, ...]:
    lightning = tuple(
        Rule(f"{_ATTN}.{name}", f"{_MIXER}.{target}")
        for name, target in (
            ("qkv_proj.weight", "qkv.weight"),
            ("output_gate.weight", "gate.weight"),
            ("norm.weight", "norm_weight"),
            ("out_proj.weight", "out.weight"),
        )
    )
    return (
        llama_rules(q_norm=None, k_norm=None, gate=None, up=None, down=None)
        + lightning
        + expert_rules(_SPARSE, "w1", "w3", "w2", stacked=_MLP)
        + router_rules(f"{_SPARSE}.gate")
        + router_rules(f"{_MLP}.gate")
    )


# the lightning layers' decay tables, buffers Transformers saves; model/lightning.py computes them
_BUFFERS = (r"model\.layers\.\d+\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)",)
# MiniMaxConfig's defaults for what the shared reader would otherwise default differently
_DEFAULTS = {"rms_norm_eps": 1e-5, "num_key_value_heads": 8, "block_size": 256}


def _factors(raw: dict, names: tuple[str, ...]) -> tuple[float, ...]:
    """The stated (else one) values of names: linear alpha, linear beta, full alpha, full beta, mlp
    alpha, beta."""
    values = []
    for name in names:
        value = raw.get(name)
        if value is None:
            value = 1.0
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Refusal(
                f"invalid model config: {name} is {value!r}; it must be a number (the residual factor)"
            )
        values.append(float(value))
    return tuple(values)


def _with_layers(out: dict, types: list, factors: tuple[float, ...]) -> dict:
    """out with its checked layer_types and each layer's residual factors (the generic
    residual_factors)."""
    unknown = sorted({str(t) for t in types} - set(_KINDS))
    if unknown:
        raise Refusal(
            f"invalid model config: layer type {unknown[0]!r} is not supported for MiniMax; layer_types "
            "lists linear_attention and full_attention only"
        )
    lin_a, lin_b, full_a, full_b, mlp_a, mlp_b = factors
    out["layer_types"] = list(types)
    out["residual_factors"] = [
        [lin_a, lin_b, mlp_a, mlp_b] if t == "linear_attention" else [full_a, full_b, mlp_a, mlp_b]
        for t in types
    ]
    return out


def _normalize_minimax(raw: dict) -> dict:
    """Transformers' MiniMax: its class defaults, layer_types as MiniMaxConfig fills it, the
    residual factors of
    *_alpha_factor / *_beta_factor, and the residual always the sublayer's normed input."""
    out = never_biased(with_defaults(raw, _DEFAULTS))
    types = out.get("layer_types")
    layers = out.get("num_hidden_layers")
    if types is None and isinstance(layers, int) and not isinstance(layers, bool):
        types = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(layers)]
    out["residual_from_norm"] = True
    factors = _factors(
        out,
        (
            "linear_attn_alpha_factor",
            "linear_attn_beta_factor",
            "full_attn_alpha_factor",
            "full_attn_beta_factor",
            "mlp_alpha_factor",
            "mlp_beta_factor",
        ),
    )
    return _with_layers(out, types, factors) if isinstance(types, list) else out


def _normalize_text_01(raw: dict) -> dict:
    """MiniMax's own config: attn_type_list (0 lightning, 1 softmax attention) as layer_types, the
    layernorm_* factors, postnorm as the residual read."""
    out = never_biased(with_defaults(raw, _DEFAULTS))
    # read here; the shared reader refuses it for MiniMax-M2
    kinds = out.pop("attn_type_list", None)
    if kinds is not None:
        if not isinstance(kinds, list) or any(
            k not in (0, 1) or isinstance(k, bool) for k in kinds
        ):
            raise Refusal(
                f"invalid model config: attn_type_list is {kinds!r}; it must mark each layer 0 "
                "(lightning attention) or 1 (softmax attention)"
            )
        types = ["full_attention" if k == 1 else "linear_attention" for k in kinds]
    elif isinstance(out.get("layer_types"), list):
        types = out["layer_types"]
    else:
        raise Refusal(
            "invalid model config: neither attn_type_list nor layer_types is stated; MiniMax-Text-01 "
            "needs one to know which layers run lightning attention"
        )
    out["residual_from_norm"] = bool(out.get("postnorm", False))
    factors = _factors(
        out,
        (
            "layernorm_linear_attention_alpha",
            "layernorm_linear_attention_beta",
            "layernorm_full_attention_alpha",
            "layernorm_full_attention_beta",
            "layernorm_mlp_alpha",
            "layernorm_mlp_beta",
        ),
    )
    return _with_layers(out, types, factors)


def _layer_kinds(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    types = raw.get("layer_types")
    if not isinstance(types, list):
        raise Refusal(
            "invalid model config: layer_types is not stated; MiniMax needs it (or attn_type_list)"
        )
    return tuple(_KINDS[t] for t in types), ("moe",) * len(types)


_COMMON = dict(
    positions=PositionSpec(theta=1000000.0),
    moe=MoESpec(renormalize=True),
    layer_kinds=_layer_kinds,
    ignore=_BUFFERS,
    parity_reference="MiniMaxForCausalLM",
    refuse_keys={
        "shared_intermediate_size": "MiniMax's shared experts are not supported; use a "
        "checkpoint without them",
        "sliding_window": "MiniMax's sliding-window attention is not supported; state "
        "sliding_window null",
    },
)

MINIMAX_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("minimax", _rules(), normalize=_normalize_minimax, **_COMMON),
    FamilySpec("minimax_text_01", _rules(), normalize=_normalize_text_01, **_COMMON),
)
