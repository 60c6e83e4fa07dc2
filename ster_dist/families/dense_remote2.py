"""Dense Llama-like families published as remote code on the Hub (no Transformers class), as data.

- telechat: TeleChat2 and TeleChat2.5, Llama's block under transformer.h with one key_value matrix whose rows
  hold each key-value head's key and then its value, a biased output projection and a biased down_proj only.
- telechat3: Llama with attention_bias and mlp_bias; its rope_type telechat3-yarn is YaRN whose temperature
  grows by 0.07 ln(factor), read as YaRN with that attention_factor.
- TeleFLM: Llama whose muP (use_mup) multiplies the embeddings by input_mult and the logits by
  output_mult / mup_scale_factor.
- mimo: Qwen2 whose multi-token-prediction layers (model.mtp_layers.{k}: token_layernorm, hidden_layernorm,
  input_proj over [hidden; embedding], a Qwen2 block, final_layernorm, the model's lm_head) are recognised and
  never read for decoding; --speculative mtp drafts with the first (model/mtp.py).
- PanguEmbedded: Llama with biased attention projections (qkv_bias for query, key and value), mlp_bias, and
  under sandwich_norm a norm over each sublayer's output beside pre_mlp_layernorm before the feed-forward.
- nanbeige: Llama with per-head q_layernorm and k_layernorm under qk_layernorm, a looped model whose stored
  layers run num_loops times (num_hidden_layers counts every pass's), the final norm closing every pass unless
  skip_loop_final_norm.

ster_dist never runs their remote code: each is checked against the reference written in
tests/test_dense_remote2.py from seeds/000's description (Transformers' Llama or Qwen2 on renamed weights
where the block is theirs).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.normalize import ConfigProblem, biases, stated, switch
from ster_dist.families.qwen import QWEN_FAMILIES
from ster_dist.families.spec import AttentionSpec, FamilySpec, Fused, MTPSpec, QKNormSpec, Rule

_REFERENCE = "tests/test_dense_remote2.py"
_LLAMA = llama_rules(q_norm=None, k_norm=None)
_QWEN2 = next(spec for spec in QWEN_FAMILIES if spec.name == "qwen2")
# MiMo's MTP layers, as vLLM's mimo_mtp reads them: apart from the decoder's, [h; e] into input_proj, the layer
# ending in its final_layernorm, scored by the model's own lm_head
_MIMO_MTP = MTPSpec(prefix="model.mtp_layers.{k}.", token_norm="token_layernorm", hidden_norm="hidden_layernorm",
                    proj="input_proj", hidden_first=True, out_norm="final_layernorm", head=None, chain_normed=True)

# TeleChat2's names: transformer.word_embeddings, h.{i}.self_attention.{query,key_value,dense}, ln_f
_H = "transformer.h.{i}."
_TELECHAT = (
    Rule("transformer.word_embeddings.weight", "embed.weight"), Rule("lm_head.weight", "lm_head.weight"),
    Rule("transformer.ln_f.weight", "final_norm.weight"),
    Rule(f"{_H}input_layernorm.weight", "layers.{i}.attn_norm.weight"),
    Rule(f"{_H}post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight"),
    Rule(f"{_H}self_attention.query.weight", "layers.{i}.attn.q.weight"),
    # per key-value head: its key rows, then its value rows
    Rule(f"{_H}self_attention.key_value.weight",
         Fused((("layers.{i}.attn.k.weight", "one"), ("layers.{i}.attn.v.weight", "one")), groups="kv_heads")),
    *weight_and_bias(f"{_H}self_attention.dense", "layers.{i}.attn.o"),
    *weight_and_bias(f"{_H}mlp.gate_proj", "layers.{i}.mlp.gate"),
    *weight_and_bias(f"{_H}mlp.up_proj", "layers.{i}.mlp.up"),
    *weight_and_bias(f"{_H}mlp.down_proj", "layers.{i}.mlp.down"),
)
_TELECHAT_REFUSED = {
    "apply_residual_connection_post_layernorm": "TeleChat's residual after the norm is not supported; use a "
                                                "config with it false",
    "embed_layernorm": "TeleChat's norm over the embeddings is not supported; use a config with it false",
}

# openPangu-Embedded: under sandwich_norm post_attention_layernorm is the norm over attention's output and
# pre_mlp_layernorm the feed-forward's input norm; without it post_attention_layernorm is that input norm.
# The matcher gives a name two rules match to the one whose parameter the model has.
_PANGU = (llama_rules(q_norm=None, k_norm=None, mlp_norm=None, post_attn_norm="post_attention_layernorm",
                     post_mlp_norm="post_mlp_layernorm")
          + weight_and_bias("model.layers.{i}.pre_mlp_layernorm", "layers.{i}.mlp_norm")
          + weight_and_bias("model.layers.{i}.post_attention_layernorm", "layers.{i}.mlp_norm"))


def _telechat(raw: dict) -> dict:
    """No bias on query, key, value, gate or up; the output projection and down_proj biased."""
    return {**biases(raw, False, out=True), "mlp_down_bias": True}


def _telechat3(raw: dict) -> dict:
    """telechat3-yarn as YaRN with its own temperature, 0.07 ln(factor) + 1, unless attention_factor is stated."""
    out = dict(raw)
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if isinstance(params, dict) and (params.get("rope_type") or params.get("type")) == "telechat3-yarn":
            out[key] = _telechat3_yarn(params, key)
    return out


def _telechat3_yarn(params: dict, key: str) -> dict:
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ConfigProblem(f"{key} of rope_type telechat3-yarn states factor {factor!r}; state a positive "
                            "number")
    yarn = {**params, "rope_type": "yarn"}
    yarn.pop("type", None)
    if yarn.get("attention_factor") is None:
        yarn["attention_factor"] = 0.07 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return yarn


def _teleflm(raw: dict) -> dict:
    """muP's two multipliers as the generic embedding_multiplier and logit_scale."""
    out = {**raw, "embedding_multiplier": 1.0, "logit_scale": 1.0}
    if not switch(raw, "use_mup"):
        return out
    missing = [key for key in ("input_mult", "output_mult", "mup_scale_factor") if raw.get(key) is None]
    if missing:
        raise ConfigProblem(f"use_mup is set without {', '.join(missing)}; state input_mult, output_mult and "
                            "mup_scale_factor, or set use_mup false")
    if not raw["mup_scale_factor"]:
        raise ConfigProblem("mup_scale_factor is 0 under use_mup; the logits are divided by it: state its value")
    return {**out, "embedding_multiplier": raw["input_mult"],
            "logit_scale": raw["output_mult"] / raw["mup_scale_factor"]}


def _pangu(raw: dict) -> dict:
    """Every attention projection biased (query, key and value as qkv_bias says, when it does); sandwich_norm
    as the generic post-norm switch."""
    qkv = bool(stated(raw, "qkv_bias", default=True))
    return {**biases(raw, qkv, out=True, mlp=switch(raw, "mlp_bias")), "use_post_norm": switch(raw, "sandwich_norm")}


def _nanbeige(raw: dict) -> dict:
    """qk_layernorm as the generic query/key-norm switch; num_loops passes over the stored layers."""
    out = {**raw, "use_qk_norm": switch(raw, "qk_layernorm")}
    loops, stored = stated(raw, "num_loops", default=1), raw.get("num_hidden_layers")
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise ConfigProblem(f"num_loops is {loops!r}; state how many times the layers run, a whole number from 1")
    if loops == 1 or isinstance(stored, bool) or not isinstance(stored, int):
        return out  # not looped, or a layer count the shared reader refuses
    return {**out, "num_hidden_layers": stored * loops, "loop_layers": stored,
            "loop_pass_norm": not switch(raw, "skip_loop_final_norm")}


DENSE_REMOTE2_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("telechat", _TELECHAT, normalize=_telechat, refuse_keys=_TELECHAT_REFUSED,
               parity_reference=_REFERENCE),
    FamilySpec("telechat3", _LLAMA, normalize=_telechat3, parity_reference=_REFERENCE),
    FamilySpec("TeleFLM", _LLAMA, normalize=_teleflm, parity_reference=_REFERENCE),
    # Qwen2 (qwen.py) with model.mtp_layers recognised and read only to draft
    replace(_QWEN2, name="mimo", ignore=(r"model\.mtp_layers\.",), parity_reference=_REFERENCE, mtp=_MIMO_MTP),
    FamilySpec("PanguEmbedded", _PANGU, normalize=_pangu, parity_reference=_REFERENCE),
    FamilySpec("nanbeige", llama_rules(q_norm="q_layernorm", k_norm="k_layernorm"),
               attention=AttentionSpec(qk_norm=QKNormSpec("head")), normalize=_nanbeige,
               parity_reference=_REFERENCE),
)
