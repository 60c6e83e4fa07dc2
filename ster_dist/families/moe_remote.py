"""Mixture-of-experts families published as remote code on the Hub (no Transformers class), as data.

- pangu_ultra_moe (openPangu-Ultra-MoE): DeepSeek-V3's latent attention, rotating adjacent pairs, under
  Pangu's own config keys (attention_q_lora_dim, num_routed_experts, num_dense_layers, ...); a sigmoid router
  with no selection bias, renormalised (norm_topk_prob, true unless stated) and scaled by
  routed_scaling_factor, beside shared experts. Under sandwich_norm each sublayer's output passes
  post_attention_layernorm or post_mlp_layernorm and the feed-forward reads pre_mlp_layernorm; without it
  post_attention_layernorm is the feed-forward's input norm (the matcher gives a name two rules match to
  the one whose parameter the model has).
- deepseek (DeepSeek-MoE, the first DeepSeek mixture): Llama's attention, rotating by halves, with
  DeepSeek's experts: softmax over n_routed_experts, greedy, renormalised only under norm_topk_prob and never
  scaled, beside n_shared_experts ungated shared ones; dense before first_k_dense_replace and off
  moe_layer_freq.
- bailing_moe (Ling 1.x and Ling 2.0): Llama's block under Ling's names (glm.ling_rules: word_embeddings, one
  attention.query_key_value biased under use_qkv_bias, per-head query/key norms under use_qk_norm,
  attention.dense biased under use_bias), the first first_k_dense_replace layers dense, the rest routing
  beside num_shared_experts shared experts. Ling 1.x scores by softmax, greedy, renormalised under
  norm_topk_prob; Ling 2.0's score_function sigmoid chooses by the scores plus mlp.gate.expert_bias (under
  moe_router_enable_expert_bias) within its best topk_group of n_group groups, always renormalised and
  scaled by routed_scaling_factor.
- param2moe (Param2-MoE): Ling 2.0's block and router under Ling's names, its sigmoid scores stated or not,
  with Param2MoEConfig's defaults (query/key norms on, first_k_dense_replace 1, routed_scaling_factor 2.5,
  rope_theta 1e6, a tied head).

ster_dist never runs their remote code: each is checked against the reference written in
tests/test_moe_remote.py from seeds/000's description (Transformers' DeepSeek-V3, GLM-4-MoE and Llama
with DeepSeek-V2's sparse blocks, on renamed weights).
"""

from __future__ import annotations

from ster_dist.families.deepseek import latent_rules
from ster_dist.families.glm import ling_rules
from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.moe_layouts import deepseek_moe_rules
from ster_dist.families.normalize import ConfigProblem, biases, stated, switch, with_defaults
from ster_dist.families.spec import AttentionSpec, EmbeddingSpec, FamilySpec, MoESpec, PositionSpec, QKNormSpec

_REFERENCE = "tests/test_moe_remote.py"

# Pangu's spellings of DeepSeek-V3's keys: (Pangu's, DeepSeek-V3's)
_PANGU_KEYS = (("attention_q_lora_dim", "q_lora_rank"), ("attention_kv_lora_dim", "kv_lora_rank"),
               ("attention_qk_dim", "qk_nope_head_dim"), ("attention_qk_rope_dim", "qk_rope_head_dim"),
               ("attention_v_dim", "v_head_dim"), ("num_routed_experts", "n_routed_experts"),
               ("num_shared_experts", "n_shared_experts"), ("num_dense_layers", "first_k_dense_replace"))


def _pangu_ultra_moe(raw: dict) -> dict:
    """Pangu's key names read as DeepSeek-V3's (its own win where both are stated); the router sigmoid and
    greedy over every expert, renormalised unless norm_topk_prob says not; sandwich_norm as the generic
    post-norm switch; no projection biased but attention's under attention_bias."""
    own = {theirs: raw[ours] for ours, theirs in _PANGU_KEYS if raw.get(ours) is not None}
    raw = with_defaults({**raw, **own}, {"norm_topk_prob": True, "first_k_dense_replace": 0})
    return {**raw, "scoring_func": "sigmoid", "topk_method": "greedy", "mlp_bias": False,
            "attention_bias": switch(raw, "attention_bias"), "use_post_norm": switch(raw, "sandwich_norm")}


# DeepSeek-V3's latent block and experts under Pangu's norm names
_PANGU_RULES = (llama_rules(q=None, k=None, v=None, q_norm=None, k_norm=None, mlp_norm=None,
                            post_attn_norm="post_attention_layernorm", post_mlp_norm="post_mlp_layernorm")
                + weight_and_bias("model.layers.{i}.pre_mlp_layernorm", "layers.{i}.mlp_norm")
                + weight_and_bias("model.layers.{i}.post_attention_layernorm", "layers.{i}.mlp_norm")
                + latent_rules() + deepseek_moe_rules())
_PANGU_REFUSED = {
    "param_sink_number": "pangu_ultra_moe's learned attention sinks (param_sink_number) are not supported; use a "
                         "checkpoint without them",
    "use_mome": "pangu_ultra_moe's MoME convolutions (use_mome) are not supported; use a checkpoint without them",
    "index_topk": "pangu_ultra_moe's sparse attention indexer (index_topk) is not supported; use a dense-attention "
                  "checkpoint",
}


def _deepseek(raw: dict) -> dict:
    """DeepseekConfig's defaults (every layer sparse, the chosen weights kept as scored); attention_bias biases
    every attention projection, the feed-forward never."""
    raw = with_defaults(raw, {"first_k_dense_replace": 0, "moe_layer_freq": 1, "norm_topk_prob": False})
    bias = bool(stated(raw, "attention_bias", default=False))
    return {**raw, "attention_bias": bias, "attention_out_bias": bias, "mlp_bias": False}


_DEEPSEEK_REQUIRED = {
    "scoring_func": ("softmax", "DeepSeek-MoE scores its experts by softmax only"),
    "topk_method": ("greedy", "DeepSeek-MoE chooses its experts greedily only"),
}



def _bailing_moe(raw: dict) -> dict:
    """Ling 1.x (softmax: greedy, renormalised under norm_topk_prob, unscaled) or Ling 2.0 (score_function
    sigmoid: grouped selection by the biased scores, always renormalised, scaled); use_qkv_bias biases query,
    key and value, use_bias the output projection."""
    scoring = stated(raw, "score_function", default="softmax")
    # BailingMoeConfig (Ling 1.x, which states no score_function) biases the output projection unless told not;
    # BailingMoeV2Config does not
    raw = with_defaults(raw, {"first_k_dense_replace": 0, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                              "use_bias": "score_function" not in raw})
    out = {**biases(raw, switch(raw, "use_qkv_bias"), out=switch(raw, "use_bias")),
           "use_qk_norm": switch(raw, "use_qk_norm")}
    if scoring == "softmax":
        return {**out, "scoring_func": "softmax", "topk_method": "greedy", "routed_scaling_factor": 1.0}
    if scoring != "sigmoid":
        raise ConfigProblem(f"score_function is {scoring!r}; Ling scores its experts by softmax (Ling 1.x) or "
                            "sigmoid (Ling 2.0) only")
    method = "noaux_tc"
    if not stated(raw, "moe_router_enable_expert_bias", default=True):
        if int(raw["n_group"] or 1) > 1:
            raise ConfigProblem("moe_router_enable_expert_bias is false with n_group above one: groups are ranked "
                                "only with the selection bias here; set n_group to 1 or enable the bias")
        method = "greedy"
    return {**out, "scoring_func": "sigmoid", "topk_method": method, "norm_topk_prob": True}


def _param2moe(raw: dict) -> dict:
    """Ling 2.0's reading under Param2MoEConfig's defaults; its score function (score_function, or
    scoring_func as Transformers' class spells it) must be sigmoid."""
    scoring = stated(raw, "score_function", "scoring_func", default="sigmoid")
    if scoring != "sigmoid":
        raise ConfigProblem(f"score_function is {scoring!r}; Param2-MoE scores its experts by sigmoid only")
    raw = with_defaults(raw, {"first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "use_qk_norm": True,
                              "use_bias": False})
    qkv_bias = stated(raw, "use_qkv_bias", "attention_bias", default=False)
    return _bailing_moe({**raw, "score_function": "sigmoid", "use_qkv_bias": qkv_bias})


_BAILING_REFUSED = {
    "norm_head": "Ling's normalised head (norm_head) is not supported; use a checkpoint without it",
    "norm_softmax": "Ling's normalised softmax (norm_softmax) is not supported; use a checkpoint without it",
}

MOE_REMOTE_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("pangu_ultra_moe", _PANGU_RULES, attention=AttentionSpec(latent=True),
               positions=PositionSpec(interleaved=True), normalize=_pangu_ultra_moe,
               moe=MoESpec(scoring="sigmoid", scaling="always", shared="deepseek"), refuse_keys=_PANGU_REFUSED,
               parity_reference=_REFERENCE),
    FamilySpec("deepseek", llama_rules(q_norm=None, k_norm=None) + deepseek_moe_rules(), normalize=_deepseek,
               moe=MoESpec(shared="deepseek"), require_values=_DEEPSEEK_REQUIRED, parity_reference=_REFERENCE),
    FamilySpec("bailing_moe", ling_rules(), attention=AttentionSpec(qk_norm=QKNormSpec("head")),
               normalize=_bailing_moe, moe=MoESpec(scaling="always", shared="deepseek"),
               refuse_keys=_BAILING_REFUSED, parity_reference=_REFERENCE),
    FamilySpec("param2moe", ling_rules(), attention=AttentionSpec(qk_norm=QKNormSpec("head")),
               positions=PositionSpec(theta=1000000.0), embedding=EmbeddingSpec(tied=True), normalize=_param2moe,
               moe=MoESpec(scaling="always", shared="deepseek"), refuse_keys=_BAILING_REFUSED,
               parity_reference=_REFERENCE),
)
