"""Shanghai AI Laboratory's InternLM families, published as remote code on the Hub (no Transformers
model class): Llama's block under InternLM's names and bias rules, as data.

- internlm2: Llama's block under InternLM2's names; attention.wqkv holds each key-value group's
  query heads, then its key and value; `bias` (on unless stated) biases wqkv and wo, never the
  feed-forward.
- internlm3: Llama's names; `qkv_bias` biases query, key and value, `bias` the output projection.
  Transformers' config class aliases them as attention_bias and mlp_bias, so a config it rewrote is
  read under those names.

ster_dist never runs their remote code: each is checked against the plain-torch reference written in
tests/families/test_internlm_minicpm_orion_solar.py from seeds/000's description.
"""

from __future__ import annotations

from ster_dist.families.layouts import QKV_PER_KV_GROUP, fused_qkv, llama_rules
from ster_dist.families.normalize import biases, stated, with_defaults
from ster_dist.families.spec import FamilySpec

_REFERENCE = "tests/families/test_internlm_minicpm_orion_solar.py"
_INTERNLM2 = llama_rules(
    attn="attention",
    q=None,
    k=None,
    v=None,
    o="wo",
    mlp="feed_forward",
    gate="w1",
    up="w3",
    down="w2",
    attn_norm="attention_norm",
    mlp_norm="ffn_norm",
    q_norm=None,
    k_norm=None,
    embed="tok_embeddings",
    head="output",
) + fused_qkv("model.layers.{i}.attention.wqkv", **QKV_PER_KV_GROUP)
# what InternLM2's remote configuration class assumes where a config is silent
_INTERNLM2_DEFAULTS = {"rms_norm_eps": 1e-6, "bias": True}


def _internlm2(raw: dict) -> dict:
    raw = with_defaults(raw, _INTERNLM2_DEFAULTS)
    return biases(raw, bool(stated(raw, "bias", default=True)))


def _internlm3(raw: dict) -> dict:
    # the remote class's names first; Transformers' config class writes them back as attention_bias
    # and mlp_bias
    qkv = bool(stated(raw, "qkv_bias", "attention_bias", default=False))
    out = bool(stated(raw, "bias", "mlp_bias", default=False))
    return biases(raw, qkv, out)


INTERNLM_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("internlm2", _INTERNLM2, normalize=_internlm2, parity_reference=_REFERENCE),
    FamilySpec(
        "internlm3",
        llama_rules(q_norm=None, k_norm=None),
        normalize=_internlm3,
        parity_reference=_REFERENCE,
    ),
)
