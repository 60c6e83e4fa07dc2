"""The Mamba-1 lineage (Transformers' MambaMixer, model/mamba.py):

- mamba, falcon_mamba: every block a norm, the Mamba mixer and the residual, with no attention and
  no feed-forward; names below backbone., the head tied to the embedding unless stated otherwise.
  Falcon Mamba RMS-norms dt, B and C without weights.
- jamba: Mamba layers with one attention layer (no positions) every attn_layer_period from
  attn_layer_offset, each followed by a dense feed-forward or, every expert_layer_period from
  expert_layer_offset, a top-k softmax mixture of experts left unnormalised; its Mamba layers
  RMS-norm dt, B and C with weights.

Normalisation restates each family's mixer settings under the keys the mixer reads (Jamba's names:
mamba_d_state, mamba_d_conv, mamba_dt_rank, ...) with Transformers' defaults, checking them under
the names the config states them by, and the inner width as Transformers reads it: a stated
intermediate_size (every config Transformers saves states it, and its MambaConfig keeps a stated one
over its own), else expand x hidden_size.
"""

from __future__ import annotations

import math

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules
from ster_dist.families.spec import EmbeddingSpec, FamilySpec, Fused, MoESpec, PositionSpec, Rule


def mamba_mixer_rules(
    layer: str, module: str = "mixer", target: str = "layers.{i}.mixer"
) -> tuple[Rule, ...]:
    """A MambaMixer's tensors below `layer` (a template ending in ".") at `module`: in_proj holds x,
    then z; Jamba's norms of dt, B and C (Falcon Mamba's carry no weights)."""
    in_proj = Fused(
        (
            (f"{target}.in_x.weight", "mamba_intermediate"),
            (f"{target}.in_z.weight", "mamba_intermediate"),
        ),
        unit="one",
    )
    in_bias = Fused(
        (
            (f"{target}.in_x.bias", "mamba_intermediate"),
            (f"{target}.in_z.bias", "mamba_intermediate"),
        ),
        unit="one",
    )
    m = f"{layer}{module}."
    return (
        Rule(f"{m}in_proj.weight", in_proj),
        Rule(f"{m}in_proj.bias", in_bias),
        Rule(f"{m}conv1d.weight", f"{target}.conv_weight"),
        Rule(f"{m}conv1d.bias", f"{target}.conv_bias"),
        Rule(f"{m}x_proj.weight", f"{target}.x_proj.weight"),
        Rule(f"{m}dt_proj.weight", f"{target}.dt_proj.weight"),
        Rule(f"{m}dt_proj.bias", f"{target}.dt_proj.bias"),
        Rule(f"{m}A_log", f"{target}.A_log"),
        Rule(f"{m}D", f"{target}.D"),
        Rule(f"{m}out_proj.weight", f"{target}.out_proj.weight"),
        Rule(f"{m}out_proj.bias", f"{target}.out_proj.bias"),
        *(
            Rule(f"{m}{name}_layernorm.weight", f"{target}.{name}_norm.weight")
            for name in ("dt", "b", "c")
        ),
    )


def _mamba_rules() -> tuple[Rule, ...]:
    b = "backbone."
    return (
        Rule(f"{b}embeddings.weight", "embed.weight"),
        # the original checkpoints' name (Transformers renames it)
        Rule(f"{b}embedding.weight", "embed.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        Rule(f"{b}norm_f.weight", "final_norm.weight"),
        Rule(f"{b}layers.{{i}}.norm.weight", "layers.{i}.attn_norm.weight"),
        *mamba_mixer_rules(f"{b}layers.{{i}}."),
    )


def _positive(raw: dict, key: str, default, whole: bool = True):
    value = raw.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int if whole else (int, float))
        or value <= 0
    ):
        kind = "whole number" if whole else "number"
        raise Refusal(
            f"invalid model config: {key} is {value!r}; Mamba needs a positive {kind} there"
        )
    return value


def _flag(raw: dict, key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise Refusal(f"invalid model config: {key} is {value!r}; state true or false")
    return value


def _normalize(raw: dict, dt_norm: str) -> dict:
    """The mixer's settings under its own keys, checked here under the names the config states them
    by."""
    hidden = _positive(raw, "hidden_size", None)
    rank = raw.get("time_step_rank", "auto")
    out = dict(raw)
    expanded = int(_positive(raw, "expand", 2, whole=False) * hidden)
    out.update(
        mamba_intermediate_size=(
            _positive(raw, "intermediate_size", None)
            if raw.get("intermediate_size") is not None
            else expanded
        ),
        mamba_dt_rank=math.ceil(hidden / 16)
        if rank == "auto"
        else _positive(raw, "time_step_rank", None),
        mamba_d_state=_positive(raw, "state_size", 16),
        mamba_d_conv=_positive(raw, "conv_kernel", 4),
        mamba_conv_bias=_flag(raw, "use_conv_bias", True),
        mamba_proj_bias=_flag(raw, "use_bias", False),
        mamba_dt_norm=dt_norm,
        mamba_norm_eps=_positive(raw, "mixer_rms_eps", 1e-6, whole=False),
    )
    out.setdefault("residual_in_fp32", True)
    out.setdefault("layer_norm_epsilon", 1e-5)
    out.setdefault("hidden_act", "silu")
    return out


def _jamba_rules() -> tuple[Rule, ...]:
    ff = "model.layers.{i}.feed_forward"
    return (
        llama_rules(
            mlp="feed_forward",
            mlp_norm="pre_ff_layernorm",
            final_norm="final_layernorm",
            q_norm=None,
            k_norm=None,
        )
        + expert_rules(ff)
        + router_rules(f"{ff}.router")
        + mamba_mixer_rules("model.layers.{i}.", "mamba")
    )


def _normalize_jamba(raw: dict) -> dict:
    hidden = _positive(raw, "hidden_size", None)
    rank = raw.get("mamba_dt_rank", "auto")
    out = dict(raw)
    out.update(
        mamba_intermediate_size=_positive(raw, "mamba_expand", 2) * hidden,
        mamba_dt_rank=math.ceil(hidden / 16)
        if rank == "auto"
        else _positive(raw, "mamba_dt_rank", None),
        mamba_d_state=_positive(raw, "mamba_d_state", 16),
        mamba_d_conv=_positive(raw, "mamba_d_conv", 4),
        mamba_conv_bias=_flag(raw, "mamba_conv_bias", True),
        mamba_proj_bias=_flag(raw, "mamba_proj_bias", False),
        mamba_dt_norm="weighted",
        mamba_norm_eps=_positive(raw, "rms_norm_eps", 1e-6, whole=False),
    )
    for key, default in (("attn_layer_period", 8), ("expert_layer_period", 2)):
        out[key] = _positive(raw, key, default)
    for key, default, period in (
        ("attn_layer_offset", 4, "attn_layer_period"),
        ("expert_layer_offset", 1, "expert_layer_period"),
    ):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < out[period]:
            raise Refusal(
                f"invalid model config: {key} is {value!r}; it must be a whole number below "
                f"{period} ({out[period]})"
            )
        out[key] = value
    out["num_experts"] = _positive(raw, "num_experts", 16)
    out["num_experts_per_tok"] = _positive(raw, "num_experts_per_tok", 2)
    # every layer dense: the routing Transformers never builds must still read
    if out["num_experts"] == 1:
        out["num_experts_per_tok"] = 1
    return out


def _jamba_layers(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Transformers' layers_block_type and layers_num_experts: attention where i % attn_layer_period
    is attn_layer_offset, experts where i % expert_layer_period is expert_layer_offset (and there
    are several)."""
    mixers = tuple(
        "attention" if i % raw["attn_layer_period"] == raw["attn_layer_offset"] else "mamba"
        for i in range(num_layers)
    )
    sparse = raw["num_experts"] > 1
    feed_forwards = tuple(
        "moe"
        if sparse and i % raw["expert_layer_period"] == raw["expert_layer_offset"]
        else "dense"
        for i in range(num_layers)
    )
    return mixers, feed_forwards


def _pure_mamba(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ("mamba",) * num_layers, ("none",) * num_layers


# positions enter only through the recurrence (and Jamba's causal order)
_UNROTATED = PositionSpec(kind="none")

MAMBA_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "mamba",
        _mamba_rules(),
        positions=_UNROTATED,
        embedding=EmbeddingSpec(tied=True),
        normalize=lambda raw: _normalize(raw, "none"),
        layer_kinds=_pure_mamba,
        parity_reference="MambaForCausalLM",
    ),
    # Falcon Mamba: RMS norms without weights over dt, B and C (at mixer_rms_eps) before the scan
    FamilySpec(
        "falcon_mamba",
        _mamba_rules(),
        positions=_UNROTATED,
        embedding=EmbeddingSpec(tied=True),
        normalize=lambda raw: _normalize(raw, "weightless"),
        layer_kinds=_pure_mamba,
        parity_reference="FalconMambaForCausalLM",
    ),
    # attention without positions; experts from a softmax over all, the chosen weights left as they
    # are
    FamilySpec(
        "jamba",
        _jamba_rules(),
        positions=_UNROTATED,
        moe=MoESpec(renormalize=False),
        normalize=_normalize_jamba,
        layer_kinds=_jamba_layers,
        parity_reference="JambaForCausalLM",
    ),
)
