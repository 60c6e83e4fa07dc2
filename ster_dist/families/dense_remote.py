"""Dense families published as remote code on the Hub (no Transformers model class): Llama's block with another
name map, bias rule, norm kind or muP scales, read from the seed's description of each, and checked against the
plain-torch reference in tests/test_dense_remote.py.

- internlm2: Llama's block under InternLM2's names; attention.wqkv holds each key-value group's query heads,
  then its key and value; `bias` (on unless stated) biases wqkv and wo, never the feed-forward.
- internlm3: Llama's names; `qkv_bias` biases query, key and value, `bias` the output projection. Transformers'
  config class aliases them as attention_bias and mlp_bias, so a config it rewrote is read under those names.
- minicpm: Llama's names, a tied head by default, the embedding times scale_emb, each sublayer's output times
  scale_depth / sqrt(layers) and the logits times dim_model_base / hidden_size (config.from_hf reads these three
  keys for every family). MiniCPM-MoE's experts, and MiniCPM 4's use_mup false, are refused.
- orion: Llama's names with biased LayerNorms (epsilon under rms_norm_eps).
- solar (Solar Pro): Llama with block skip connections: the hidden state kept before the layers bskcn_1 (and
  bskcn_2) list is mixed back in before those bskcn_3 (and bskcn_4) list, weighted by bskcn_tv's second number
  (the inference weight; the first is training's), written as the generic block_skips.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import QKV_PER_KV_GROUP, fused_qkv, llama_rules
from ster_dist.families.normalize import biases, stated, with_defaults
from ster_dist.families.spec import EmbeddingSpec, FamilySpec, NormSpec

_REFERENCE = "tests/test_dense_remote.py"
_LLAMA = llama_rules(q_norm=None, k_norm=None)
_INTERNLM2 = llama_rules(
    attn="attention", q=None, k=None, v=None, o="wo", mlp="feed_forward", gate="w1", up="w3", down="w2",
    attn_norm="attention_norm", mlp_norm="ffn_norm", q_norm=None, k_norm=None, embed="tok_embeddings",
    head="output",
) + fused_qkv("model.layers.{i}.attention.wqkv", **QKV_PER_KV_GROUP)
# what each remote configuration class assumes where a config is silent
_INTERNLM2_DEFAULTS = {"rms_norm_eps": 1e-6, "bias": True}
_MINICPM_DEFAULTS = {"scale_emb": 1, "scale_depth": 1, "dim_model_base": 1, "rms_norm_eps": 1e-6}


def _internlm2(raw: dict) -> dict:
    raw = with_defaults(raw, _INTERNLM2_DEFAULTS)
    return biases(raw, bool(stated(raw, "bias", default=True)))


def _internlm3(raw: dict) -> dict:
    # the remote class's names first; Transformers' config class writes them back as attention_bias and mlp_bias
    qkv = bool(stated(raw, "qkv_bias", "attention_bias", default=False))
    out = bool(stated(raw, "bias", "mlp_bias", default=False))
    return biases(raw, qkv, out)


def _minicpm(raw: dict) -> dict:
    return biases(with_defaults(raw, _MINICPM_DEFAULTS), bool(stated(raw, "attention_bias", default=False)))


def _orion(raw: dict) -> dict:
    raw = with_defaults(raw, {"rms_norm_eps": 1e-5})
    return biases(raw, bool(stated(raw, "attention_bias", default=False)))


def _solar(raw: dict) -> dict:
    skips = [raw.get(key) for key in ("bskcn_1", "bskcn_2", "bskcn_3", "bskcn_4")]
    weights = raw.get("bskcn_tv")
    if any(not isinstance(s, list) for s in skips) or not isinstance(weights, list) or len(weights) != 2:
        raise Refusal("invalid model config: solar needs bskcn_1, bskcn_2, bskcn_3 and bskcn_4 (lists of layers) "
                      "and bskcn_tv (the training and inference weights); state them as Solar Pro's config does")
    keep_1, keep_2, mix_1, mix_2 = skips
    return {**raw, "block_skips": [[keep_1, mix_1, weights[1]], [keep_2, mix_2, weights[1]]]}


_MOE = "MiniCPM-MoE's experts are not supported; use a dense MiniCPM checkpoint"
# MiniCPM 4's switch for its muP scales; ster_dist applies them always, as the seed describes MiniCPM
_NO_MUP = "MiniCPM without its muP scales is not supported; use a checkpoint that applies them (use_mup true)"
DENSE_REMOTE_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("internlm2", _INTERNLM2, normalize=_internlm2, parity_reference=_REFERENCE),
    FamilySpec("internlm3", _LLAMA, normalize=_internlm3, parity_reference=_REFERENCE),
    FamilySpec("minicpm", _LLAMA, embedding=EmbeddingSpec(tied=True), normalize=_minicpm,
               refuse_keys={"num_experts": _MOE}, require_values={"use_mup": (True, _NO_MUP)},
               parity_reference=_REFERENCE),
    FamilySpec("orion", _LLAMA, norms=NormSpec(kind="layer", bias=True), normalize=_orion,
               parity_reference=_REFERENCE),
    FamilySpec("solar", _LLAMA, normalize=_solar, parity_reference=_REFERENCE),
)
