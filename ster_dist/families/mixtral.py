"""Mixtral and the sparse families Transformers builds from its classes: Llama's attention over a
top-k softmax router whose experts sit under block_sparse_moe (Transformers 5 saves them stacked
under mlp).

- mixtral: Mistral's block (a sliding window on every layer) over renormalised top-k experts.
- phimoe: Mixtral's tensors (the router also saved as mlp.router) under biased LayerNorms, biased
  attention, an optional head bias, LongRoPE with short_mscale / long_mscale, and SparseMixer's
  eval-time routing.
- minimax_m2: Mixtral's names with whole-projection query/key norms and a sigmoid router whose
  selection bias sits beside the gate.
- gpt_oss: Mixtral's router over biased, clamped-SwiGLU experts stored inputs-first with gate and up
  interleaved, and a learned sink per head.
"""

from __future__ import annotations

from ster_dist.families.layouts import ATTENTION_SINKS, llama_rules
from ster_dist.families.moe_layouts import EXPERTS, ROUTER_CORRECTION, expert_rules, router_rules
from ster_dist.families.normalize import never_biased, switch, with_defaults
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

_MLP = "model.layers.{i}.mlp"
_SPARSE = "model.layers.{i}.block_sparse_moe"


def _mixtral_rules() -> tuple[Rule, ...]:
    return (
        llama_rules(q_norm=None, k_norm=None, gate=None, up=None, down=None)
        + expert_rules(_SPARSE, "w1", "w3", "w2", stacked=_MLP)
        + router_rules(f"{_SPARSE}.gate")
        + router_rules(f"{_MLP}.gate")
    )


def _minimax_m2_rules() -> tuple[Rule, ...]:
    return (
        llama_rules(gate=None, up=None, down=None)
        + expert_rules(_SPARSE, "w1", "w3", "w2", stacked=_MLP)
        + router_rules(f"{_SPARSE}.gate")
        + router_rules(f"{_MLP}.gate")
        + (
            Rule(f"{_SPARSE}.e_score_correction_bias", ROUTER_CORRECTION),
            Rule(f"{_MLP}.e_score_correction_bias", ROUTER_CORRECTION),
        )
    )


def _gpt_oss_rules() -> tuple[Rule, ...]:
    experts = f"{_MLP}.experts."
    return (
        llama_rules(q_norm=None, k_norm=None, gate=None, up=None, down=None)
        + router_rules(f"{_MLP}.router")
        + (
            ATTENTION_SINKS,
            Rule(
                f"{experts}gate_up_proj",
                Stacked((f"{EXPERTS}gate", f"{EXPERTS}up"), interleaved=True, transposed=True),
            ),
            Rule(
                f"{experts}gate_up_proj_bias",
                Stacked((f"{EXPERTS}gate_bias", f"{EXPERTS}up_bias"), interleaved=True),
            ),
            Rule(f"{experts}down_proj", Stacked((f"{EXPERTS}down",), transposed=True)),
            Rule(f"{experts}down_proj_bias", Stacked((f"{EXPERTS}down_bias",))),
        )
    )


def _minimax_m2(raw: dict) -> dict:
    """No projection biased; the query/key norms on unless use_qk_norm says not (Transformers always
    norms, and MiniMax's configs leave the key out)."""
    raw = never_biased(with_defaults(raw, {"use_qk_norm": True}))
    return {**raw, "use_qk_norm": switch(raw, "use_qk_norm")}


MIXTRAL_FAMILIES: tuple[FamilySpec, ...] = (
    # no projection biased, whatever the config says
    FamilySpec(
        "mixtral",
        _mixtral_rules(),
        attention=AttentionSpec(sliding="all"),
        normalize=never_biased,
        moe=MoESpec(renormalize=True),
        parity_reference="MixtralForCausalLM",
    ),
    # PhiMoE: Mixtral's tensors (Transformers 5 saves the router as mlp.router) under biased
    # LayerNorms, biased
    # attention, an optional head bias (lm_head_bias), LongRoPE with short_mscale / long_mscale, and
    # SparseMixer's
    # routing
    FamilySpec(
        "phimoe",
        _mixtral_rules() + router_rules(f"{_MLP}.router"),
        norms=NormSpec(kind="layer", bias=True),
        attention=AttentionSpec(sliding="all"),
        positions=PositionSpec(theta=1000000.0),
        moe=MoESpec(sparsemixer=True),
        parity_reference="PhimoeForCausalLM",
    ),
    FamilySpec(
        "minimax_m2",
        _minimax_m2_rules(),
        attention=AttentionSpec(qk_norm=QKNormSpec("proj")),
        positions=PositionSpec(theta=5000000.0),
        normalize=_minimax_m2,
        refuse_keys={"shared_intermediate_size": "MiniMax's shared experts are not supported"},
        require_values={
            "scoring_func": ("sigmoid", "only MiniMax-M2's sigmoid scores are supported"),
            "qk_norm_type": ("per_layer", "only whole-projection query/key norms are supported"),
            "use_routing_bias": (True, "routing without the selection bias is not supported"),
        },
        moe=MoESpec(scoring="sigmoid", renormalize=True, correction_bias=True),
        parity_reference="MiniMaxM2ForCausalLM",
    ),
    FamilySpec(
        "gpt_oss",
        _gpt_oss_rules(),
        attention=AttentionSpec(sinks=True),
        moe=MoESpec(
            renormalize=True, router_bias=True, expert_bias=True, activation="clamped_swiglu"
        ),
        parity_reference="GptOssForCausalLM",
    ),
)
