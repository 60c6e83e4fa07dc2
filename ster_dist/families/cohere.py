"""Cohere's Command families: a parallel block (attention and feed-forward from one LayerNorm without bias),
adjacent pairs rotating, a tied head scaled by logit_scale.

- cohere (Command R): per-head LayerNorm query/key norms when use_qk_norm is set.
- cohere2 (Command R7B): Cohere's block without query/key norms; sliding layers by pattern, and only they rotate.
- cohere2_moe: Cohere 2's block (RMS norms when rms_norm_eps is stated) whose dense prefix rotates and has its
  own width, over a softmax-of-chosen or sigmoid router whose shared experts may be averaged with the routed
  ones before the one TP all-reduce.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import deepseek_moe_rules
from ster_dist.families.spec import FamilySpec, MoESpec

COHERE_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("cohere", llama_rules(mlp_norm=None), norm_kind="layer", parallel_block=True, rope_interleaved=True,
               qk_norm="head", qk_norm_key="use_qk_norm", qk_norm_kind="layer", qk_norm_per_head_weight=True,
               tied_default=True, o_bias_keys=("attention_bias",), mlp_bias_keys=(),
               parity_reference="CohereForCausalLM"),
    # Cohere 2 (Command R7B): Cohere's parallel block without query/key norms; only sliding layers rotate
    FamilySpec("cohere2", llama_rules(mlp_norm=None, q_norm=None, k_norm=None), norm_kind="layer",
               parallel_block=True, rope_interleaved=True, tied_default=True, o_bias_keys=("attention_bias",),
               mlp_bias_keys=(), sliding="pattern", rope_layers="sliding",
               config_defaults={"sliding_window": 4096, "sliding_window_pattern": 4},
               parity_reference="Cohere2ForCausalLM"),
    FamilySpec("cohere2_moe", llama_rules(mlp_norm=None, q_norm=None, k_norm=None) + deepseek_moe_rules(),
               norm_kind="layer", rms_norm_key="rms_norm_eps", parallel_block=True, rope_interleaved=True,
               tied_default=True, mlp_bias_keys=(), sliding="pattern", rope_layers="sliding",
               dense_rope_key="prefix_dense_sliding_window_pattern",
               dense_intermediate_keys=("prefix_dense_intermediate_size",),
               config_defaults={"sliding_window": 4096, "sliding_window_pattern": 4, "logit_scale": 0.0625,
                                "prefix_dense_sliding_window_pattern": 1, "norm_topk_prob": True,
                                "shared_expert_combination_strategy": "average"},
               require_values={"use_qk_norm": (False, "Cohere 2 MoE's query/key norms are not supported"),
                               "use_gated_activation": (True, "only the gated feed-forward is supported")},
               moe=MoESpec(shared="deepseek", scoring_keys=("expert_selection_fn",), softmax_renormalized=True,
                           shared_combination_key="shared_expert_combination_strategy"),
               parity_reference="Cohere2MoeForCausalLM"),
)
