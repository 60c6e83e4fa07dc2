"""Cohere's Command families: a parallel block (attention and feed-forward from one LayerNorm
without bias), adjacent pairs rotating, a tied head scaled by logit_scale.

- cohere (Command R): per-head LayerNorm query/key norms when use_qk_norm is set.
- cohere2 (Command R7B): Cohere's block without query/key norms; sliding layers by pattern, and only
  they rotate.
- cohere2_moe: Cohere 2's block (RMS norms when rms_norm_eps is stated) whose dense prefix rotates
  and has its own width, over a softmax-of-chosen or sigmoid router whose shared experts may be
  averaged with the routed ones before the one TP all-reduce.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import deepseek_moe_rules
from ster_dist.families.normalize import defaults, stated, switch, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    MoESpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
)

# a parallel block fed by one LayerNorm without bias, adjacent pairs rotating, a tied head
_NORMS = NormSpec(kind="layer", parallel=True)
_TIED = EmbeddingSpec(tied=True)
# Cohere 2: sliding layers by pattern (every fourth full when layer_types is unstated), and only
# they rotate
_SLIDING = AttentionSpec(sliding="pattern")
_SLIDING_ROTATE = PositionSpec(interleaved=True, layers="sliding")
_SLIDING_DEFAULTS = {"sliding_window": 4096, "sliding_window_pattern": 4}


def _cohere2_moe(raw: dict) -> dict:
    """RMS norms when rms_norm_eps is stated; the dense prefix rotates under
    prefix_dense_sliding_window_pattern 1 and is prefix_dense_intermediate_size wide; the router
    scores by expert_selection_fn."""
    raw = with_defaults(
        raw,
        {
            **_SLIDING_DEFAULTS,
            "logit_scale": 0.0625,
            "prefix_dense_sliding_window_pattern": 1,
            "norm_topk_prob": True,
            "shared_expert_combination_strategy": "average",
        },
    )
    return {
        **raw,
        "norm_kind": "rms" if stated(raw, "rms_norm_eps") is not None else None,
        "dense_layers_rotate": stated(raw, "prefix_dense_sliding_window_pattern") == 1,
        "dense_intermediate_size": raw.get("prefix_dense_intermediate_size"),
        "scoring_func": raw.get("expert_selection_fn"),
    }


COHERE_FAMILIES: tuple[FamilySpec, ...] = (
    # the per-head query/key LayerNorms only under use_qk_norm
    FamilySpec(
        "cohere",
        llama_rules(mlp_norm=None),
        norms=_NORMS,
        positions=PositionSpec(interleaved=True),
        attention=AttentionSpec(qk_norm=QKNormSpec("head", kind="layer", per_head_weight=True)),
        embedding=_TIED,
        normalize=lambda raw: {**raw, "use_qk_norm": switch(raw, "use_qk_norm")},
        parity_reference="CohereForCausalLM",
    ),
    # Cohere 2 (Command R7B): Cohere's parallel block without query/key norms; only sliding layers
    # rotate
    FamilySpec(
        "cohere2",
        llama_rules(mlp_norm=None, q_norm=None, k_norm=None),
        norms=_NORMS,
        attention=_SLIDING,
        positions=_SLIDING_ROTATE,
        embedding=_TIED,
        normalize=defaults(_SLIDING_DEFAULTS),
        parity_reference="Cohere2ForCausalLM",
    ),
    FamilySpec(
        "cohere2_moe",
        llama_rules(mlp_norm=None, q_norm=None, k_norm=None) + deepseek_moe_rules(),
        norms=_NORMS,
        attention=_SLIDING,
        positions=_SLIDING_ROTATE,
        embedding=_TIED,
        normalize=_cohere2_moe,
        require_values={
            "use_qk_norm": (False, "Cohere 2 MoE's query/key norms are not supported"),
            "use_gated_activation": (True, "only the gated feed-forward is supported"),
        },
        moe=MoESpec(shared="deepseek", softmax_renormalized=True),
        parity_reference="Cohere2MoeForCausalLM",
    ),
)
