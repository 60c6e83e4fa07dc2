"""Further mixture-of-experts families (Mellum, MiniMax-M2, GraniteMoE SWA, Cohere 2 MoE, Sarvam MoE, EXAONE MoE, PhiMoE).

Mellum is Qwen3-MoE whose layer kinds (layer_types, mlp_layer_types) and per-kind rope_parameters
the shared config reading already covers; MiniMax-M2 is Mixtral's block_sparse_moe names with
whole-projection query/key norms and a sigmoid router whose selection bias sits beside the gate;
GraniteMoE SWA is GraniteMoE shared with GPT-OSS's per-head sinks, layer_types and layer_rope_theta;
EXAONE MoE is EXAONE 4's attention in a pre-norm block over DeepSeek-V3's router and shared experts;
Cohere 2 MoE is Cohere 2's parallel block (RMS norms when rms_norm_eps is stated) whose dense prefix
rotates and has its own width, over a softmax-of-chosen or sigmoid router whose shared experts may be
averaged with the routed ones; Sarvam MoE is Ling 2.0's layout (a fused query_key_value, per-head
query/key norms) over GLM-4-MoE's router, which Transformers runs it as.
"""

from __future__ import annotations

from ster_dist.families.layouts import fused_qkv, llama_rules
from ster_dist.families.moe import (
    V3_ROUTER,
    expert_rules,
    mixtral_rules,
    router_rules,
    shared_rules,
)
from ster_dist.families.moe_variants import granitemoeshared_rules
from ster_dist.families.spec import FamilySpec, MoESpec, Rule

_MLP = "model.layers.{i}.mlp"
_CORRECTION = "layers.{i}.mlp.router.correction"
_SINKS = Rule("model.layers.{i}.self_attn.sinks", "layers.{i}.attn.sinks.weight")


def _minimax_m2_rules() -> tuple[Rule, ...]:
    moe = "model.layers.{i}.block_sparse_moe"
    return (llama_rules(gate=None, up=None, down=None) + expert_rules(moe, "w1", "w3", "w2", stacked=_MLP)
            + router_rules(f"{moe}.gate") + router_rules(f"{_MLP}.gate")
            + (Rule(f"{moe}.e_score_correction_bias", _CORRECTION),
               Rule(f"{_MLP}.e_score_correction_bias", _CORRECTION)))


def _moe_rules() -> tuple[Rule, ...]:
    return expert_rules(_MLP) + router_rules(f"{_MLP}.gate") + shared_rules(f"{_MLP}.shared_experts")


def _sarvam_moe_rules() -> tuple[Rule, ...]:
    # Ling 2.0's names: word_embeddings, attention.query_key_value ([q | k | v]), attention.dense, the per-head
    # query_layernorm / key_layernorm and the router's expert_bias
    return (llama_rules(attn="attention", q=None, k=None, v=None, o="dense", q_norm="query_layernorm",
                        k_norm="key_layernorm", embed="word_embeddings")
            + fused_qkv("model.layers.{i}.attention.query_key_value") + _moe_rules()
            + (Rule(f"{_MLP}.gate.expert_bias", _CORRECTION),))


def _exaone_moe_rules() -> tuple[Rule, ...]:
    return llama_rules() + _moe_rules() + (Rule(f"{_MLP}.e_score_correction_bias", _CORRECTION),)


MOE_EXTRA_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("mellum", llama_rules() + expert_rules(_MLP) + router_rules(f"{_MLP}.gate"), qk_norm="head",
               mlp_bias_keys=(), ignore=(r"mtp\..*",), moe=MoESpec(), parity_reference="MellumForCausalLM"),
    FamilySpec("minimax_m2", _minimax_m2_rules(), qk_norm="proj", qk_norm_key="use_qk_norm", qkv_bias_keys=(),
               o_bias_keys=(), mlp_bias_keys=(), default_rope_theta=5000000.0,
               config_defaults={"use_qk_norm": True},  # Transformers always norms; MiniMax's configs leave it out
               refuse_keys={"shared_intermediate_size": "MiniMax's shared experts are not supported"},
               require_values={"scoring_func": ("sigmoid", "only MiniMax-M2's sigmoid scores are supported"),
                               "qk_norm_type": ("per_layer", "only whole-projection query/key norms are supported"),
                               "use_routing_bias": (True, "routing without the selection bias is not supported")},
               moe=MoESpec(scoring="sigmoid", renormalize=True, correction_bias=True),
               parity_reference="MiniMaxM2ForCausalLM"),
    FamilySpec("granitemoe_swa", granitemoeshared_rules() + (_SINKS,), attn_sinks=True, mlp_bias_keys=(),
               moe=MoESpec(renormalize=True, shared="stated"), parity_reference="GraniteMoeSWAForCausalLM"),
    FamilySpec("exaone_moe", _exaone_moe_rules(), qk_norm="head", qkv_bias_keys=(), o_bias_keys=(), mlp_bias_keys=(),
               sliding="pattern", rope_layers="sliding", ignore=(r"mtp\..*",),
               config_defaults={"sliding_window": 4096, "sliding_window_pattern": 4, "first_k_dense_replace": 1,
                                "num_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
               moe=V3_ROUTER, parity_reference="ExaoneMoeForCausalLM"),
    FamilySpec("cohere2_moe", llama_rules(mlp_norm=None, q_norm=None, k_norm=None) + _moe_rules(), norm_kind="layer",
               rms_norm_key="rms_norm_eps", parallel_block=True, rope_interleaved=True, tied_default=True,
               mlp_bias_keys=(), sliding="pattern", rope_layers="sliding",
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
    FamilySpec("sarvam_moe", _sarvam_moe_rules(), qk_norm="head", qk_norm_key="use_qk_norm",
               qkv_bias_keys=("attention_bias", "use_qkv_bias"), o_bias_keys=(), mlp_bias_keys=(),
               default_rope_theta=8000000.0,
               config_defaults={"first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": True,
                                "routed_scaling_factor": 2.5},
               moe=V3_ROUTER, parity_reference="Glm4MoeForCausalLM"),
    # PhiMoE: Mixtral's tensors (Transformers 5 saves the router as mlp.router) under biased LayerNorms, biased
    # attention, an optional head bias, LongRoPE with short_mscale / long_mscale, and SparseMixer's routing
    FamilySpec("phimoe", mixtral_rules() + router_rules(f"{_MLP}.router"), norm_kind="layer", norm_bias=True,
               sliding="all", mlp_bias_keys=(), lm_head_bias_keys=("lm_head_bias",), default_rope_theta=1000000.0,
               moe=MoESpec(sparsemixer=True), parity_reference="PhimoeForCausalLM"),
)
