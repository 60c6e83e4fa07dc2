"""Huawei's openPangu families, published as remote code on the Hub (no Transformers class), as
data.

- PanguEmbedded: Llama with biased attention projections (qkv_bias for query, key and value),
  mlp_bias, and under sandwich_norm a norm over each sublayer's output beside pre_mlp_layernorm
  before the feed-forward.
- pangu_ultra_moe (openPangu-Ultra-MoE): DeepSeek-V3's latent attention, rotating adjacent pairs,
  under Pangu's own config keys (attention_q_lora_dim, num_routed_experts, num_dense_layers, ...); a
  sigmoid router with no selection bias, renormalised (norm_topk_prob, true unless stated) and
  scaled by routed_scaling_factor, beside shared experts. Under sandwich_norm each sublayer's output
  passes post_attention_layernorm or post_mlp_layernorm and the feed-forward reads
  pre_mlp_layernorm; without it post_attention_layernorm is the feed-forward's input norm (the
  matcher gives a name two rules match to the one whose parameter the model has).

ster_dist never runs their remote code: each is checked against the reference written from
seeds/000's description in the test file its spec names: PanguEmbedded in
tests/families/test_telechat_mimo_pangu_nanbeige.py (Transformers' Llama on renamed weights without
sandwich_norm, a plain-torch forward with it), pangu_ultra_moe in
tests/families/test_pangu_ultra_deepseek_moe_ling.py (Transformers' DeepSeek-V3 with one expert
group).
"""

from __future__ import annotations

from ster_dist.families.deepseek import latent_rules
from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.moe_layouts import deepseek_moe_rules
from ster_dist.families.normalize import biases, stated, switch, with_defaults
from ster_dist.families.spec import AttentionSpec, FamilySpec, MoESpec, PositionSpec

# Both: under sandwich_norm post_attention_layernorm is the norm over attention's output and
# pre_mlp_layernorm
# the feed-forward's input norm; without it post_attention_layernorm is that input norm. The matcher
# gives a name
# two rules match to the one whose parameter the model has.
_NORMS = dict(
    q_norm=None,
    k_norm=None,
    mlp_norm=None,
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_mlp_layernorm",
)
_FEED_FORWARD_NORM = weight_and_bias(
    "model.layers.{i}.pre_mlp_layernorm", "layers.{i}.mlp_norm"
) + weight_and_bias("model.layers.{i}.post_attention_layernorm", "layers.{i}.mlp_norm")
_PANGU = llama_rules(**_NORMS) + _FEED_FORWARD_NORM
# DeepSeek-V3's latent block and experts under Pangu's norm names
_PANGU_ULTRA = (
    llama_rules(q=None, k=None, v=None, **_NORMS)
    + _FEED_FORWARD_NORM
    + latent_rules()
    + deepseek_moe_rules()
)


def _pangu(raw: dict) -> dict:
    """Every attention projection biased (query, key and value as qkv_bias says, when it does);
    sandwich_norm as the generic post-norm switch."""
    qkv = bool(stated(raw, "qkv_bias", default=True))
    return {
        **biases(raw, qkv, out=True, mlp=switch(raw, "mlp_bias")),
        "use_post_norm": switch(raw, "sandwich_norm"),
    }


# Pangu's spellings of DeepSeek-V3's keys: (Pangu's, DeepSeek-V3's)
_PANGU_KEYS = (
    ("attention_q_lora_dim", "q_lora_rank"),
    ("attention_kv_lora_dim", "kv_lora_rank"),
    ("attention_qk_dim", "qk_nope_head_dim"),
    ("attention_qk_rope_dim", "qk_rope_head_dim"),
    ("attention_v_dim", "v_head_dim"),
    ("num_routed_experts", "n_routed_experts"),
    ("num_shared_experts", "n_shared_experts"),
    ("num_dense_layers", "first_k_dense_replace"),
)


def _pangu_ultra_moe(raw: dict) -> dict:
    """Pangu's key names read as DeepSeek-V3's (its own win where both are stated); the router
    sigmoid and greedy over every expert, renormalised unless norm_topk_prob says not; sandwich_norm
    as the generic post-norm switch; no projection biased but attention's under attention_bias."""
    own = {theirs: raw[ours] for ours, theirs in _PANGU_KEYS if raw.get(ours) is not None}
    raw = with_defaults({**raw, **own}, {"norm_topk_prob": True, "first_k_dense_replace": 0})
    return {
        **raw,
        "scoring_func": "sigmoid",
        "topk_method": "greedy",
        "mlp_bias": False,
        "attention_bias": switch(raw, "attention_bias"),
        "use_post_norm": switch(raw, "sandwich_norm"),
    }


_PANGU_REFUSED = {
    "param_sink_number": "pangu_ultra_moe's learned attention sinks (param_sink_number) are not supported; use a "
    "checkpoint without them",
    "use_mome": "pangu_ultra_moe's MoME convolutions (use_mome) are not supported; use a checkpoint without them",
    "index_topk": "pangu_ultra_moe's sparse attention indexer (index_topk) is not supported; use a dense-attention "
    "checkpoint",
}


PANGU_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "PanguEmbedded",
        _PANGU,
        normalize=_pangu,
        parity_reference="tests/families/test_telechat_mimo_pangu_nanbeige.py",
    ),
    FamilySpec(
        "pangu_ultra_moe",
        _PANGU_ULTRA,
        attention=AttentionSpec(latent=True),
        positions=PositionSpec(interleaved=True),
        normalize=_pangu_ultra_moe,
        moe=MoESpec(scoring="sigmoid", scaling="always", shared="deepseek"),
        refuse_keys=_PANGU_REFUSED,
        parity_reference="tests/families/test_pangu_ultra_deepseek_moe_ling.py",
    ),
)
