"""IBM's Granite families, dense and sparse, and HyperCLOVA X, which Transformers builds from
Granite's classes. All carry Granite's multipliers (embedding, residual, attention, logits_scaling
dividing the logits).

- granite: Llama's block with those multipliers.
- granite_swa: Granite with a learned sink per head (GPT-OSS's), sliding layers (all but the first
  of each four when layer_types is unstated) and layer_rope_theta, where zero leaves a layer
  unrotated.
- hyperclovax: Granite with a norm over each sublayer's output (use_post_norm) and logits_scaling
  multiplying.
- granitemoe: Granite's attention over renormalised top-k experts stored stacked (input_linear /
  output_linear).
- granitemoeshared: GraniteMoE plus a fused shared_mlp as wide as shared_intermediate_size.
- granitemoe_swa: GraniteMoE shared with Granite SWA's sinks, layer_types and layer_rope_theta.
- granitemoehybrid (Granite 4.0): GraniteMoE shared whose token mixer is Mamba-2 (mamba, Bamba's
  mamba_* keys) on the layers layer_types calls mamba and attention (rotating only under
  position_embedding_type rope) on the rest. Without experts (num_local_experts 0) it is a dense
  model whose shared_mlp is the feed-forward: shared_mlp's tensors then fill mlp.gate / up / down,
  which the shard plan prefers when the model has them (shard/names.py NameMatcher).
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import ATTENTION_SINKS, llama_rules
from ster_dist.families.mamba2 import bamba_mixer_keys, mamba2_mixer_rules
from ster_dist.families.moe_layouts import EXPERTS, expert_rules, router_rules
from ster_dist.families.normalize import defaults, stated, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    Fused,
    MoESpec,
    Rule,
    Stacked,
)

_LLAMA = llama_rules(q_norm=None, k_norm=None)
_GRANITE_SWA_DEFAULTS = {
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "sliding_window": 128,
    "sliding_window_pattern": 4,
}
_SHARED = "layers.{i}.mlp.shared."


def _granitemoe_rules() -> tuple[Rule, ...]:
    moe = "model.layers.{i}.block_sparse_moe"
    return (
        llama_rules(q_norm=None, k_norm=None, gate=None, up=None, down=None)
        + (
            Rule(f"{moe}.input_linear.weight", Stacked((f"{EXPERTS}gate", f"{EXPERTS}up"))),
            Rule(f"{moe}.output_linear.weight", Stacked((f"{EXPERTS}down",))),
        )
        + expert_rules(moe, stacked=moe)
        + router_rules(f"{moe}.router.layer")
        + router_rules(f"{moe}.router")
    )


def _granitemoeshared_rules() -> tuple[Rule, ...]:
    shared = "model.layers.{i}.shared_mlp"
    gate_up = Fused(
        (
            (f"{_SHARED}gate.weight", "shared_intermediate"),
            (f"{_SHARED}up.weight", "shared_intermediate"),
        ),
        unit="one",
    )
    return _granitemoe_rules() + (
        Rule(f"{shared}.input_linear.weight", gate_up),
        Rule(f"{shared}.output_linear.weight", f"{_SHARED}down.weight"),
    )


def _hyperclovax(raw: dict) -> dict:
    """The post norms on unless use_post_norm says not; logits_scaling multiplies the logits
    (Granite's divides), so it is read as logit_scale."""
    raw = with_defaults(raw, {"use_post_norm": True})
    if stated(raw, "logits_scaling") is None:
        return raw
    return {**raw, "logit_scale": raw["logits_scaling"], "logits_scaling": None}


# Granite SWA's learned sink per head and sliding layers (all but the first of each four when
# layer_types is
# unstated); layer_rope_theta's zero leaves a layer unrotated
_SWA = AttentionSpec(sinks=True, sliding="pattern_first")


# Granite 4.0's layer names (Transformers 5 writes its own for the same two kinds)
_HYBRID_KINDS = {
    "mamba": "linear_attention",
    "linear_attention": "linear_attention",
    "attention": "full_attention",
    "full_attention": "full_attention",
}


def _normalize_granitemoehybrid(raw: dict) -> dict:
    kinds = raw.get("layer_types", raw.get("layers_block_type"))
    if not isinstance(kinds, list) or not kinds or not all(kind in _HYBRID_KINDS for kind in kinds):
        raise Refusal(
            f"invalid model config: granitemoehybrid's layer_types {kinds!r} is not a list of mamba and "
            "attention; state one of the two for every layer"
        )
    if (
        not isinstance(raw.get("shared_intermediate_size"), int)
        or raw["shared_intermediate_size"] < 1
    ):
        raise Refusal(
            "invalid model config: granitemoehybrid needs shared_intermediate_size (the shared_mlp's "
            "width); state it"
        )
    positions = raw.get("position_embedding_type")
    if positions not in (None, "nope", "rope"):
        raise Refusal(
            f"invalid model config: position_embedding_type {positions!r} is not supported; "
            "use rope or nope (no position signal)"
        )
    out = bamba_mixer_keys(raw)
    out["mlp_bias"] = False  # no feed-forward bias, whatever mlp_bias says
    out["layer_types"] = [_HYBRID_KINDS[kind] for kind in kinds]
    out["num_hidden_layers"] = len(kinds)
    out.setdefault("rms_norm_eps", 1e-6)
    if positions != "rope":  # Transformers builds no rotary embedding: attention sees no positions
        out["no_rope_layers"] = [0] * len(kinds)
    out.setdefault("num_local_experts", 8)  # Transformers' default
    if not out["num_local_experts"]:  # no experts (the key goes: a stated count is at least one)
        del out["num_local_experts"]
        # shared_mlp alone is the dense feed-forward
        out["intermediate_size"] = out["shared_intermediate_size"]
    return out


def _granitemoehybrid_layers(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    mixers = tuple(
        "mamba2" if kind == "linear_attention" else "attention" for kind in raw["layer_types"]
    )
    return mixers, ("moe" if raw.get("num_local_experts") else "dense",) * layers


def _granitemoehybrid_rules() -> tuple[Rule, ...]:
    shared = "model.layers.{i}.shared_mlp"
    dense = Fused(
        (
            ("layers.{i}.mlp.gate.weight", "intermediate"),
            ("layers.{i}.mlp.up.weight", "intermediate"),
        ),
        unit="one",
    )
    # the dense feed-forward's names first: adapters (which do not know the model's parameters) find
    # them
    return (
        (
            Rule(f"{shared}.input_linear.weight", dense),
            Rule(f"{shared}.output_linear.weight", "layers.{i}.mlp.down.weight"),
        )
        + _granitemoeshared_rules()
        + mamba2_mixer_rules("model.layers.{i}.mamba")
    )


GRANITE_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("granite", _LLAMA, parity_reference="GraniteForCausalLM"),
    FamilySpec(
        "granite_swa",
        _LLAMA + (ATTENTION_SINKS,),
        attention=_SWA,
        embedding=EmbeddingSpec(tied=True),
        normalize=defaults(_GRANITE_SWA_DEFAULTS),
        parity_reference="GraniteSWAForCausalLM",
    ),
    # HyperCLOVA X: Granite with a norm over each sublayer's output (use_post_norm) and
    # logits_scaling multiplying
    FamilySpec(
        "hyperclovax",
        llama_rules(
            post_attn_norm="post_norm1", post_mlp_norm="post_norm2", q_norm=None, k_norm=None
        ),
        normalize=_hyperclovax,
        parity_reference="HyperCLOVAXForCausalLM",
    ),
    FamilySpec(
        "granitemoe",
        _granitemoe_rules(),
        moe=MoESpec(renormalize=True),
        parity_reference="GraniteMoeForCausalLM",
    ),
    FamilySpec(
        "granitemoeshared",
        _granitemoeshared_rules(),
        moe=MoESpec(renormalize=True, shared="stated"),
        parity_reference="GraniteMoeSharedForCausalLM",
    ),
    FamilySpec(
        "granitemoe_swa",
        _granitemoeshared_rules() + (ATTENTION_SINKS,),
        attention=AttentionSpec(sinks=True),
        moe=MoESpec(renormalize=True, shared="stated"),
        parity_reference="GraniteMoeSWAForCausalLM",
    ),
    FamilySpec(
        "granitemoehybrid",
        _granitemoehybrid_rules(),
        moe=MoESpec(renormalize=True, shared="stated"),
        normalize=_normalize_granitemoehybrid,
        layer_kinds=_granitemoehybrid_layers,
        parity_reference="GraniteMoeHybridForCausalLM",
    ),
)
