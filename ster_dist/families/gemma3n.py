"""Gemma 3n's text decoder (gemma3n_text; the gemma3n image-audio-text wrapper's language model).

Gemma 3's sliding and full layers (layer_types, sliding layers rotating at rope_local_base_freq)
with per-head query and key norms, a scale-free norm over each value head, scores left undivided,
and:

- KV sharing: the last num_kv_shared_layers layers make no keys or values of their own; each attends
  those of the last earlier layer of its own kind (sliding or full). Releases store k/v projections
  and key norms for those layers too, which nothing reads (Transformers ignores them as well).
- AltUp (model/altup.py): altup_num_inputs copies of the hidden state, predicted and corrected
  around each block, with per-layer inputs (embed_tokens_per_layer, per_layer_model_projection;
  model/per_layer_input.py, shared with Gemma 4) added to all but the first.
- Laurel (model/laurel.py): a low-rank residual beside attention, averaged with attention's (divided
  by sqrt 2).
- Activation sparsity: on layers whose activation_sparsity_pattern entry p is above zero, the gate
  keeps only what lies above its mean plus Phi^-1(p) standard deviations (layers/mlp.py).

Its norms scale by their stored weight (no offset from one, unlike Gemma's), and the embedding is
scaled by sqrt(hidden) and tied to the head, whose logits are soft-capped.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.normalize import (
    ConfigProblem,
    biases,
    shared_kv_sources,
    stated,
    with_defaults,
)
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)

# Gemma3nTextConfig's defaults (the E4B sizes)
_DEFAULTS = {
    "vocab_size": 262_400,
    "hidden_size": 2048,
    "intermediate_size": 16_384,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "final_logit_softcapping": 30.0,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "altup_num_inputs": 4,
    "altup_correct_scale": True,
    "num_kv_shared_layers": 15,
    "laurel_rank": 64,
    "tie_word_embeddings": True,
}


def _layer_types(raw: dict, layers: int) -> list[str]:
    # Gemma3nTextConfig's rule when unstated: every fifth layer attends fully
    return stated(
        raw,
        "layer_types",
        default=[
            "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)
        ],
    )


def _normalize(raw: dict) -> dict:
    out = with_defaults(raw, _DEFAULTS)
    layers = out["num_hidden_layers"]
    sparsity = stated(
        out,
        "activation_sparsity_pattern",
        default=[0.95] * (10 if layers > 10 else 0) + [0.0] * (layers - (10 if layers > 10 else 0)),
    )
    kinds = _layer_types(out, layers)
    shared = stated(out, "num_kv_shared_layers", default=0)
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared <= layers:
        raise ConfigProblem(
            f"num_kv_shared_layers is {shared!r}; state a count of layers from 0 to {layers}"
        )
    return {
        **biases(out, bool(stated(out, "attention_bias", default=False))),
        "layer_types": kinds,
        "gate_sparsity_layers": sparsity,
        "value_norm": True,
        "kv_source_layers": shared_kv_sources(kinds, shared) if shared else None,
        # scores left undivided: the query and key norms stand in for the scale
        "attention_multiplier": 1.0,
    }


_LAYER = "model.layers.{i}."
# the key and value tensors of a shared layer are stored but never read: optional where the layer
# has none
_SHARED_KV = tuple(
    Rule(f"{_LAYER}self_attn.{name}.{part}", f"layers.{{i}}.attn.{target}.{part}", optional=True)
    for name, target in (("k_proj", "k"), ("v_proj", "v"), ("k_norm", "k_norm"))
    for part in ("weight", "bias")
)
_ALTUP_LAYER = tuple(
    Rule(f"{_LAYER}{name}", f"layers.{{i}}.{target}")
    for name, target in (
        ("altup.correct_output_scale", "altup.correct_output_scale.weight"),
        ("altup.correction_coefs.weight", "altup.correction_coefs.weight"),
        ("altup.prediction_coefs.weight", "altup.prediction_coefs.weight"),
        ("altup.modality_router.weight", "altup.modality_router.weight"),
        ("altup.router_norm.weight", "altup.router_norm.weight"),
        ("per_layer_input_gate.weight", "altup.input_gate.weight"),
        ("per_layer_projection.weight", "altup.input_projection.weight"),
        ("post_per_layer_input_norm.weight", "altup.input_norm.weight"),
        ("laurel.linear_left.weight", "laurel.left.weight"),
        ("laurel.linear_right.weight", "laurel.right.weight"),
        ("laurel.post_laurel_norm.weight", "laurel.norm.weight"),
    )
)
_ALTUP_MODEL = tuple(
    Rule(f"model.{name}", target)
    for name, target in (
        ("embed_tokens_per_layer.weight", "per_layer_inputs.embed.weight"),
        ("per_layer_model_projection.weight", "per_layer_inputs.projection.weight"),
        ("per_layer_projection_norm.weight", "per_layer_inputs.norm.weight"),
        ("altup_projections.{s}.weight", "altup.projections.{s}.weight"),
        ("altup_unembed_projections.{s}.weight", "altup.unembed_projections.{s}.weight"),
    )
)
_RULES = (
    llama_rules(
        k=None,
        v=None,
        k_norm=None,
        mlp_norm="pre_feedforward_layernorm",
        post_attn_norm="post_attention_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
    )
    + _SHARED_KV
    + _ALTUP_LAYER
    + _ALTUP_MODEL
)

GEMMA3N_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "gemma3n_text",
        _RULES,
        attention=AttentionSpec(qk_norm=QKNormSpec("head")),
        norms=NormSpec(post=True, scale_f32=True),
        embedding=EmbeddingSpec(tied=True, scale_sqrt=True),
        positions=PositionSpec(theta=1_000_000.0, local_theta=10_000.0),
        normalize=_normalize,
        require_values={
            "altup_active_idx": (0, "the blocks run on AltUp's first copy only; state 0")
        },
        parity_reference="Gemma3nForCausalLM",
    ),
)
