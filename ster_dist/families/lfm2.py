"""LFM2 (Liquid AI): short-convolution layers (model/short_conv.py) and attention layers with
per-head query/key norms, picked per layer by `layer_types` ("conv" / "full_attention"), each
followed by a gated SiLU feed-forward (w1, w3, w2); the norm Transformers calls embedding_norm is
the final norm.

- lfm2: a dense feed-forward on every layer, its width derived from intermediate_size as
  block_auto_adjust_ff_dim, block_ffn_dim_multiplier and block_multiple_of say.
- lfm2_moe: dense feed-forwards on the first num_dense_layers layers, experts on the rest, routed by
  sigmoid scores chosen with a selection bias (expert_bias), renormalised and scaled.

Decoder parameters of a short-convolution layer: layers.{i}.mixer.{in_proj,conv,out_proj}.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.moe_layouts import ROUTER_CORRECTION, expert_rules
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    MoESpec,
    QKNormSpec,
    Rule,
)

_LAYER = "model.layers.{i}."
_BLOCK = llama_rules(
    o="out_proj",
    gate="w1",
    up="w3",
    down="w2",
    mlp="feed_forward",
    attn_norm="operator_norm",
    mlp_norm="ffn_norm",
    q_norm="q_layernorm",
    k_norm="k_layernorm",
    final_norm="embedding_norm",
)
_SHORT_CONV = tuple(
    rule
    for name in ("in_proj", "conv", "out_proj")
    for rule in weight_and_bias(f"{_LAYER}conv.{name}", f"layers.{{i}}.mixer.{name}")
)
_MOE = expert_rules(f"{_LAYER}feed_forward", gate="w1", up="w3", down="w2") + (
    Rule(f"{_LAYER}feed_forward.gate.weight", "layers.{i}.mlp.router.weight"),
    Rule(f"{_LAYER}feed_forward.expert_bias", ROUTER_CORRECTION),
)

_MIXERS = {"conv": "short_conv", "full_attention": "attention"}


def _stated(raw: dict, key: str, default):
    """The config's value, or Transformers' default where it is missing or null."""
    return default if raw.get(key) is None else raw[key]


def _normalize(raw: dict) -> dict:
    """LFM2's own names and defaults, as Transformers' config classes read them."""
    raw = dict(raw)
    if raw.get("block_ff_dim") is not None:
        raw["intermediate_size"] = raw["block_ff_dim"]
    if raw.get("tie_embedding") is not None:
        raw["tie_word_embeddings"] = raw["tie_embedding"]
    raw["norm_eps"] = _stated(raw, "norm_eps", 1e-5)
    layers = raw.get("num_hidden_layers")
    if raw.get("layer_types") is None and isinstance(layers, int):
        attention = raw.get("full_attn_idxs")
        if attention is not None and not isinstance(attention, list):
            raise Refusal(
                f"invalid model config: full_attn_idxs is {attention!r}; list the attention layers' "
                "indices, or state layer_types"
            )
        attention = range(layers) if attention is None else attention
        raw["layer_types"] = ["full_attention" if i in attention else "conv" for i in range(layers)]
    params = raw.get("rope_parameters") or {}
    if raw.get("rope_theta") is None and not params.get("rope_theta"):
        raw["rope_theta"] = 1_000_000.0
    return raw


def _dense_width(raw: dict) -> dict:
    """LFM2's feed-forward width: two thirds of intermediate_size, times the multiplier, rounded up
    to block_multiple_of, when block_auto_adjust_ff_dim (the default) asks."""
    raw = _normalize(raw)
    inner = _stated(raw, "intermediate_size", 12288)
    if _stated(raw, "block_auto_adjust_ff_dim", True) and isinstance(inner, int):
        inner = int(2 * inner / 3)
        # a stated null keeps two thirds as they are
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = _stated(raw, "block_multiple_of", 256)
            if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
                raise Refusal(
                    f"invalid model config: block_multiple_of is {multiple!r}; state a positive integer"
                )
            if (
                isinstance(multiplier, bool)
                or not isinstance(multiplier, (int, float))
                or multiplier <= 0
            ):
                raise Refusal(
                    f"invalid model config: block_ffn_dim_multiplier is {multiplier!r}; state a positive "
                    "number, or null for none"
                )
            inner = int(multiplier * inner)
            inner = multiple * ((inner + multiple - 1) // multiple)
    raw["intermediate_size"] = inner
    return raw


def _moe_config(raw: dict) -> dict:
    raw = _normalize(raw)
    dense = _stated(raw, "num_dense_layers", 2)
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise Refusal(
            f"invalid model config: num_dense_layers is {dense!r}; state how many leading layers keep "
            "the dense feed-forward as a count"
        )
    raw["first_k_dense_replace"] = dense
    raw["norm_topk_prob"] = _stated(raw, "norm_topk_prob", True)
    # the selection bias (expert_bias) joins the sigmoid scores to choose; without it they choose
    # alone
    raw["topk_method"] = "noaux_tc" if _stated(raw, "use_expert_bias", True) else "greedy"
    return raw


def _mixers(raw: dict, num_layers: int) -> tuple[str, ...]:
    kinds = raw.get("layer_types") or []
    unknown = sorted({str(kind) for kind in kinds} - set(_MIXERS))
    if unknown:
        raise Refusal(
            f'invalid model config: layer_types names {unknown[0]!r}; LFM2\'s layers are "conv" or '
            '"full_attention"'
        )
    return tuple(_MIXERS[kind] for kind in kinds)


def _dense_kinds(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return _mixers(raw, num_layers), ("dense",) * num_layers


def _moe_kinds(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    dense = raw["first_k_dense_replace"]  # num_dense_layers, checked by _moe_config
    return _mixers(raw, num_layers), tuple(
        "dense" if i < dense else "moe" for i in range(num_layers)
    )


# per-head query/key norms, a head tied to the embedding unless the config says otherwise
_LFM2 = dict(
    attention=AttentionSpec(qk_norm=QKNormSpec("head")), embedding=EmbeddingSpec(tied=True)
)

LFM2_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "lfm2",
        _BLOCK + _SHORT_CONV,
        **_LFM2,
        normalize=_dense_width,
        layer_kinds=_dense_kinds,
        parity_reference="Lfm2ForCausalLM",
    ),
    FamilySpec(
        "lfm2_moe",
        _BLOCK + _SHORT_CONV + _MOE,
        **_LFM2,
        normalize=_moe_config,
        layer_kinds=_moe_kinds,
        moe=MoESpec(scoring="sigmoid", scaling="always"),
        parity_reference="Lfm2MoeForCausalLM",
    ),
)
