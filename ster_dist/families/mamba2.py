"""Mamba-2 and the hybrids Transformers builds from its mixer (model/mamba2.py): each normalisation maps the
family's own names for the mixer's settings onto Bamba's (mamba_n_heads, mamba_d_head, ...), which the
mixer reads.

- mamba2: every layer a norm and a Mamba-2 mixer, no feed-forward (state-spaces' Mamba-2, Codestral Mamba).
- bamba: Llama's blocks whose token mixer is Mamba-2 except at attn_layer_indices, where it is attention
  rotating half of each head.

Codestral's config states norm_before_gate true; Transformers ignores it (the gate always multiplies before
the norm), and so does ster_dist.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.spec import FamilySpec, Rule


def _mixer_rules(layer: str) -> tuple[Rule, ...]:
    """One Mamba-2 mixer's tensors under `layer` (a template with {i}), into layers.{i}.mixer."""
    into = "layers.{i}.mixer"
    return (*weight_and_bias(f"{layer}.in_proj", f"{into}.in_proj"), *weight_and_bias(f"{layer}.conv1d", f"{into}.conv1d"),
            *weight_and_bias(f"{layer}.out_proj", f"{into}.out_proj"), Rule(f"{layer}.norm.weight", f"{into}.norm.weight"),
            *(Rule(f"{layer}.{name}", f"{into}.{name}") for name in ("A_log", "D", "dt_bias")))


def _rename(raw: dict, names: dict[str, str], defaults: dict) -> dict:
    """raw with each family key's value (or Transformers' default where unstated) under the mixer's name."""
    out = dict(raw)
    for own, mixer in names.items():
        value = raw.get(own)
        out[mixer] = defaults[own] if value is None else value
    return out


# Mamba2Config's names and defaults
_MAMBA2_NAMES = {"num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "state_size": "mamba_d_state",
                 "n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "expand": "mamba_expand",
                 "use_conv_bias": "mamba_conv_bias", "use_bias": "mamba_proj_bias", "hidden_act": "mamba_hidden_act"}
_MAMBA2_DEFAULTS = {"num_heads": 128, "head_dim": 64, "state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2,
                    "use_conv_bias": True, "use_bias": False, "hidden_act": "silu"}


def _normalize_mamba2(raw: dict) -> dict:
    out = _rename(raw, _MAMBA2_NAMES, _MAMBA2_DEFAULTS)
    out.setdefault("layer_norm_epsilon", 1e-5)
    if isinstance(out.get("hidden_size"), int) and isinstance(out["mamba_expand"], int):
        out["intermediate_size"] = out["mamba_expand"] * out["hidden_size"]
    return out


def _every_layer_mamba2(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ("mamba2",) * layers, ("none",) * layers


# BambaConfig's defaults (its names are the mixer's); mamba_d_head "auto" is expand x hidden / heads
_BAMBA_DEFAULTS = {"mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
                   "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False}


def _normalize_bamba(raw: dict) -> dict:
    out = _rename(raw, {key: key for key in _BAMBA_DEFAULTS}, _BAMBA_DEFAULTS)
    if out["mamba_d_head"] == "auto" and isinstance(out.get("hidden_size"), int):
        out["mamba_d_head"] = out["mamba_expand"] * out["hidden_size"] // out["mamba_n_heads"]
    out["mamba_hidden_act"] = raw.get("hidden_act") or "silu"
    for key, value in (("rms_norm_eps", 1e-5), ("num_key_value_heads", 8), ("max_position_embeddings", 262144),
                       ("partial_rotary_factor", 0.5)):
        if out.get(key) is None:
            out[key] = value
    return out


def _bamba_layers(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    indices = raw.get("attn_layer_indices") or []
    if not isinstance(indices, list) or not all(isinstance(i, int) and 0 <= i < layers for i in indices):
        raise Refusal(f"invalid model config: attn_layer_indices {indices!r} must list layer indices below "
                      f"num_hidden_layers ({layers}); correct it")
    return tuple("attention" if i in indices else "mamba2" for i in range(layers)), ("dense",) * layers


MAMBA2_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("mamba2", (Rule("backbone.embeddings.weight", "embed.weight"),
                          Rule("backbone.embedding.weight", "embed.weight"),  # the original checkpoints' name
                          Rule("lm_head.weight", "lm_head.weight"),
                          Rule("backbone.norm_f.weight", "final_norm.weight"),
                          Rule("backbone.layers.{i}.norm.weight", "layers.{i}.attn_norm.weight"),
                          *_mixer_rules("backbone.layers.{i}.mixer")),
               normalize=_normalize_mamba2, layer_kinds=_every_layer_mamba2, parity_reference="Mamba2ForCausalLM"),
    FamilySpec("bamba", llama_rules(mlp="feed_forward", mlp_norm="pre_ff_layernorm", final_norm="final_layernorm",
                                    q_norm=None, k_norm=None) + _mixer_rules("model.layers.{i}.mamba"),
               normalize=_normalize_bamba, layer_kinds=_bamba_layers, parity_reference="BambaForCausalLM"),
)
