"""Gemma 4's text decoders: Gemma 3's block (norms around both sublayers, per-head query and key
norms, the embedding times sqrt(hidden), a tied head), with every norm scaling by its weight itself,
scores not divided by the head width, each value head through a scale-free RMS norm and each layer's
output times its stored layer_scalar.

- gemma4_unified_text: layers slide or attend fully as layer_types lists (the last always fully, as
  Transformers forces it). Full layers' heads are global_head_dim wide; under attention_k_eq_v they
  have num_global_key_value_heads key-value heads and no v_proj, the value being the key projection
  before its norm. Sliding layers rotate by the sliding_attention base over their head; full layers
  by the full_attention rotation over theirs, which for rope_type proportional turns only the first
  partial_rotary_factor share of the frequency pairs. With num_kv_shared_layers, the last that many
  layers project only their queries and attend the keys and values of the last earlier layer of
  their kind.
- gemma4_text: the same, with per-layer inputs where hidden_size_per_layer_input is set (the E
  models, model/per_layer_input.py) and, under enable_moe_block, experts beside the dense
  feed-forward in every layer (model/experts_beside_dense.py): softmax top_k_experts of num_experts,
  renormalised, times router.per_expert_scale, the router reading the residual through a scale-free
  norm times router.scale and 1/sqrt(hidden).

Their image-text wrappers (gemma4, gemma4_unified) are read as these decoders
(config_file.TEXT_WRAPPERS). Transformers 5 saves a config's per-layer head sizes as
per_layer_config (layer -> head_dim, num_key_value_heads) rather than global_head_dim and
num_global_key_value_heads, which the published checkpoints state: either is read.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.normalize import ConfigProblem, shared_kv_sources, stated, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    MoESpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
    Stacked,
)

# what Gemma4TextConfig and Gemma4UnifiedTextConfig assume where a config is silent (layer_types,
# the head
# widths of full layers and the rotations have no defaults here: a config without them is refused)
_COMMON_DEFAULTS = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "tie_word_embeddings": True,
}
_TEXT_DEFAULTS = {
    **_COMMON_DEFAULTS,
    "max_position_embeddings": 131_072,
    "sliding_window": 512,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144,
    "enable_moe_block": False,
}
_UNIFIED_DEFAULTS = {**_COMMON_DEFAULTS, "max_position_embeddings": 262_144, "sliding_window": 1024}
_LAYER = "model.layers.{i}."


def _full_layer_sizes(raw: dict, layer_types: list) -> tuple[list[int], list[int]]:
    """Each layer's head width and key-value heads: global_head_dim (and, under attention_k_eq_v,
    num_global_key_value_heads) on full layers, or Transformers 5's per_layer_config."""
    head_dim, kv = raw["head_dim"], raw["num_key_value_heads"]
    per_layer = raw.get("per_layer_config")
    if raw.get("global_head_dim") is None and isinstance(per_layer, dict):
        sizes = [{}] * len(layer_types)
        for key, given in per_layer.items():
            # Transformers writes the layer numbers zero-padded to one width ("05" of twelve layers)
            index = int(key) if isinstance(key, str) and key.isdigit() else key
            if (
                isinstance(index, bool)
                or not isinstance(index, int)
                or not 0 <= index < len(layer_types)
                or not isinstance(given, dict)
            ):
                raise ConfigProblem(
                    f"per_layer_config has {key!r}, not a layer number below {len(layer_types)} "
                    "with that layer's sizes; key each layer's sizes by its number"
                )
            sizes[index] = given
        return (
            [s.get("head_dim", head_dim) for s in sizes],
            [s.get("num_key_value_heads", kv) for s in sizes],
        )
    if raw.get("global_head_dim") is None:
        raise ConfigProblem(
            "global_head_dim is unstated; state the full-attention layers' head width"
        )
    full_kv = (
        stated(raw, "num_global_key_value_heads", default=kv) if raw.get("attention_k_eq_v") else kv
    )
    full = [kind == "full_attention" for kind in layer_types]
    return (
        [raw["global_head_dim"] if f else head_dim for f in full],
        [full_kv if f else kv for f in full],
    )


def _gemma4(defaults: dict):
    def normalize(raw: dict) -> dict:
        raw = with_defaults(raw, defaults)
        if raw.get("use_bidirectional_attention") == "all":
            raise ConfigProblem(
                'use_bidirectional_attention is "all"; only causal decoding is supported: leave it '
                'unset or "vision"'
            )
        layer_types = raw.get("layer_types")
        if not isinstance(layer_types, list) or not layer_types:
            raise ConfigProblem(
                "layer_types is unstated; state each layer's sliding_attention or full_attention"
            )
        # Transformers forces the last layer to attend fully
        layer_types = [*layer_types[:-1], "full_attention"]
        rope = raw.get("rope_parameters")
        sliding = rope.get("sliding_attention") if isinstance(rope, dict) else None
        local_base = raw.get("rope_local_base_freq")
        if local_base is None and not (
            isinstance(sliding, dict) and sliding.get("rope_theta") is not None
        ):
            raise ConfigProblem(
                "the sliding-window rotation base is unstated; state rope_parameters' "
                "sliding_attention rope_theta"
            )
        if isinstance(sliding, dict) and (sliding.get("rope_type") or "default") != "default":
            raise ConfigProblem(
                f"the sliding_attention rotation is scaled ({sliding.get('rope_type')!r}); only an "
                "unscaled sliding rotation is supported"
            )
        head_dims, kv_heads = _full_layer_sizes(raw, layer_types)
        shared = stated(raw, "num_kv_shared_layers", default=0)
        if (
            isinstance(shared, bool)
            or not isinstance(shared, int)
            or not 0 <= shared < len(layer_types)
        ):
            raise ConfigProblem(
                f"num_kv_shared_layers is {shared!r}; state fewer than the {len(layer_types)} layers"
            )
        out = {
            **raw,
            "layer_types": layer_types,
            "layer_head_dim": head_dims,
            "layer_kv_heads": kv_heads,
            "value_from_key_layers": [
                int(bool(raw.get("attention_k_eq_v")) and kind == "full_attention")
                for kind in layer_types
            ],
            "kv_source_layers": shared_kv_sources(layer_types, shared),
            # scores are not divided by the head width; every value head is normed; each layer
            # scaled
            "query_pre_attn_scalar": 1,
            "value_norm": True,
            "layer_scalar": True,
            "per_layer_input_size": raw.get("hidden_size_per_layer_input") or 0,
            "per_layer_input_vocab": raw.get("vocab_size_per_layer_input"),
            "mlp_bias": False,
        }
        if raw.get("enable_moe_block"):
            out.update(num_experts_per_tok=raw.get("top_k_experts"))
        return out

    return normalize


def _text_layer_kinds(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    experts = bool(raw.get("enable_moe_block"))
    return ("attention",) * num_layers, ("dense_and_moe" if experts else "dense",) * num_layers


def _rules(per_layer_inputs: bool, experts: bool) -> tuple[Rule, ...]:
    rules = llama_rules(
        mlp_norm="pre_feedforward_layernorm",
        post_attn_norm="post_attention_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
    )
    rules += (Rule(f"{_LAYER}layer_scalar", "layers.{i}.layer_scalar.weight"),)
    if per_layer_inputs:
        rules += (
            Rule("model.embed_tokens_per_layer.weight", "per_layer_inputs.embed.weight"),
            Rule("model.per_layer_model_projection.weight", "per_layer_inputs.projection.weight"),
            Rule("model.per_layer_projection_norm.weight", "per_layer_inputs.norm.weight"),
            Rule(f"{_LAYER}per_layer_input_gate.weight", "layers.{i}.per_layer_gate.gate.weight"),
            Rule(
                f"{_LAYER}per_layer_projection.weight",
                "layers.{i}.per_layer_gate.projection.weight",
            ),
            Rule(
                f"{_LAYER}post_per_layer_input_norm.weight", "layers.{i}.per_layer_gate.norm.weight"
            ),
        )
    if experts:
        moe = "layers.{i}.mlp.moe."
        rules += (
            Rule(f"{_LAYER}router.proj.weight", f"{moe}router.weight"),
            Rule(f"{_LAYER}router.scale", f"{moe}router.input_scale"),
            Rule(f"{_LAYER}router.per_expert_scale", f"{moe}router.expert_scale"),
            Rule(
                f"{_LAYER}experts.gate_up_proj", Stacked((f"{moe}experts.gate", f"{moe}experts.up"))
            ),
            Rule(f"{_LAYER}experts.down_proj", Stacked((f"{moe}experts.down",))),
            Rule(
                f"{_LAYER}post_feedforward_layernorm_1.weight",
                "layers.{i}.mlp.dense_post_norm.weight",
            ),
            Rule(
                f"{_LAYER}pre_feedforward_layernorm_2.weight", "layers.{i}.mlp.experts_norm.weight"
            ),
            Rule(
                f"{_LAYER}post_feedforward_layernorm_2.weight",
                "layers.{i}.mlp.experts_post_norm.weight",
            ),
        )
    return rules


_COMMON = dict(
    attention=AttentionSpec(qk_norm=QKNormSpec("head")),
    norms=NormSpec(post=True),
    embedding=EmbeddingSpec(tied=True, scale_sqrt=True),
    positions=PositionSpec(theta=1_000_000.0),
    refuse_keys={"use_double_wide_mlp": "double-wide feed-forwards are not supported"},
)

GEMMA4_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "gemma4_text",
        _rules(per_layer_inputs=True, experts=True),
        normalize=_gemma4(_TEXT_DEFAULTS),
        layer_kinds=_text_layer_kinds,
        moe=MoESpec(renormalize=True, router_input_norm=True),
        parity_reference="Gemma4ForCausalLM",
        **_COMMON,
    ),
    FamilySpec(
        "gemma4_unified_text",
        _rules(per_layer_inputs=False, experts=False),
        normalize=_gemma4(_UNIFIED_DEFAULTS),
        parity_reference="Gemma4UnifiedForCausalLM",
        **_COMMON,
    ),
)
