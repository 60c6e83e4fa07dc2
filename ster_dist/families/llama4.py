"""Llama 4's text decoder: Llama's block with its attention varied per layer and experts on some
layers.

- llama4_text: layers no_rope_layers marks 0 (every no_rope_layer_interval-th by default) do not
  rotate and attend fully; the others rotate by adjacent pairs and, where attention_chunk_size is
  stated, attend by chunks of that many positions (layer_types' chunked_attention). Under
  use_qk_norm the rotating layers' queries and keys pass a weightless RMS (L2) norm after the
  rotation; under attn_temperature_tuning the unrotated layers' queries at position p are multiplied
  by 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)). The layers moe_layers lists (else every
  interleave_moe_layer_step-th) route each token by sigmoid scores to num_experts_per_tok of
  num_local_experts experts (stacked inputs-first in feed_forward.experts.gate_up_proj and
  down_proj), each reading its input already multiplied by its score, beside
  feed_forward.shared_expert (intermediate_size wide, as the experts are); the other layers are
  dense, intermediate_size_mlp wide. Its image-text wrapper (llama4) is read as its text decoder
  (config_file.text_weight_names: below language_model; the vision tower is skipped).

Every per-layer difference is stated as per-layer config keys (layer_types, no_rope_layers,
qk_norm_layers, query_temperature_layers, mlp_layer_types) that config.from_hf reads for every
family.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import EXPERTS, router_rules, shared_rules
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    MoESpec,
    PositionSpec,
    QKNormSpec,
    Rule,
    Stacked,
)

_FEED_FORWARD = "model.layers.{i}.feed_forward"
# what Llama4TextConfig assumes where a config is silent (the sizes every config states are left to
# the reader)
_DEFAULTS = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
}


def _positive_int(raw: dict, key: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigProblem(f"{key} is {value!r}; state a positive integer")
    return value


def _llama4(raw: dict) -> dict:
    """Llama4TextConfig's defaults and derived lists, as the generic per-layer keys."""
    raw = with_defaults(raw, _DEFAULTS)
    layers = stated(raw, "num_hidden_layers", default=48)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return raw  # the shared reader refuses the layer count itself
    interval, step = (
        _positive_int(raw, "no_rope_layer_interval"),
        _positive_int(raw, "interleave_moe_layer_step"),
    )
    rotating = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(rotating, list) or len(rotating) != layers:
        raise ConfigProblem(f"no_rope_layers must list 0 or 1 for each of the {layers} layers")
    moe = raw.get("moe_layers")
    moe = set(range(step - 1, layers, step) if moe is None else moe)
    chunk = raw.get("attention_chunk_size")
    kinds = raw.get("layer_types") or [
        "chunked_attention" if rotates and chunk is not None else "full_attention"
        for rotates in rotating
    ]
    out = {
        **raw,
        "no_rope_layers": rotating,
        "layer_types": kinds,
        "mlp_layer_types": ["sparse" if i in moe else "dense" for i in range(layers)],
        "dense_intermediate_size": raw["intermediate_size_mlp"],
        "shared_intermediate_size": raw["intermediate_size"],
        # the L2 norm sits in the rotating layers only
        "qk_norm_layers": [int(bool(rotates)) for rotates in rotating],
    }
    if raw.get("attn_temperature_tuning"):
        out.update(
            query_temperature_beta=raw["attn_scale"],
            query_temperature_length=_positive_int(raw, "floor_scale"),
            query_temperature_offset=1,
            query_temperature_layers=[int(not rotates) for rotates in rotating],
        )
    return out


def _llama4_rules() -> tuple[Rule, ...]:
    experts = f"{_FEED_FORWARD}.experts."
    return (
        llama_rules(mlp="feed_forward", q_norm=None, k_norm=None)
        + router_rules(f"{_FEED_FORWARD}.router")
        + shared_rules(f"{_FEED_FORWARD}.shared_expert")
        + (
            Rule(
                f"{experts}gate_up_proj",
                Stacked((f"{EXPERTS}gate", f"{EXPERTS}up"), transposed=True),
            ),
            Rule(f"{experts}down_proj", Stacked((f"{EXPERTS}down",), transposed=True)),
        )
    )


LLAMA4_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "llama4_text",
        _llama4_rules(),
        attention=AttentionSpec(qk_norm=QKNormSpec(after_rope=True, affine=False)),
        positions=PositionSpec(interleaved=True, theta=500000.0),
        normalize=_llama4,
        moe=MoESpec(scoring="sigmoid", renormalize=False, shared="stated", weight_input=True),
        parity_reference="Llama4ForCausalLM",
    ),
)
