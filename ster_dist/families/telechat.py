"""TeleAI's decoders (TeleChat, TeleChat3, Tele-FLM), published as remote code on the Hub (no
Transformers class), as data.

- telechat: TeleChat2 and TeleChat2.5, Llama's block under transformer.h with one key_value matrix
  whose rows hold each key-value head's key and then its value, a biased output projection and a
  biased down_proj only.
- telechat3: Llama with attention_bias and mlp_bias; its rope_type telechat3-yarn is YaRN whose
  temperature grows by 0.07 ln(factor), read as YaRN with that attention_factor.
- TeleFLM: Llama whose muP (use_mup) multiplies the embeddings by input_mult and the logits by
  output_mult / mup_scale_factor.

ster_dist never runs their remote code: each is checked against the reference written in
tests/families/test_telechat_mimo_pangu_nanbeige.py from seeds/000's description (Transformers'
Llama on renamed weights).
"""

from __future__ import annotations

import math

from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.normalize import ConfigProblem, biases, switch
from ster_dist.families.spec import FamilySpec, Fused, Rule

_REFERENCE = "tests/families/test_telechat_mimo_pangu_nanbeige.py"
_LLAMA = llama_rules(q_norm=None, k_norm=None)

# TeleChat2's names: transformer.word_embeddings, h.{i}.self_attention.{query,key_value,dense}, ln_f
_H = "transformer.h.{i}."
_TELECHAT = (
    Rule("transformer.word_embeddings.weight", "embed.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
    Rule("transformer.ln_f.weight", "final_norm.weight"),
    Rule(f"{_H}input_layernorm.weight", "layers.{i}.attn_norm.weight"),
    Rule(f"{_H}post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight"),
    Rule(f"{_H}self_attention.query.weight", "layers.{i}.attn.q.weight"),
    # per key-value head: its key rows, then its value rows
    Rule(
        f"{_H}self_attention.key_value.weight",
        Fused(
            (("layers.{i}.attn.k.weight", "one"), ("layers.{i}.attn.v.weight", "one")),
            groups="kv_heads",
        ),
    ),
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


def _telechat(raw: dict) -> dict:
    """No bias on query, key, value, gate or up; the output projection and down_proj biased."""
    return {**biases(raw, False, out=True), "mlp_down_bias": True}


def _telechat3(raw: dict) -> dict:
    """telechat3-yarn as YaRN with its own temperature, 0.07 ln(factor) + 1, unless attention_factor
    is stated."""
    out = dict(raw)
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if (
            isinstance(params, dict)
            and (params.get("rope_type") or params.get("type")) == "telechat3-yarn"
        ):
            out[key] = _telechat3_yarn(params, key)
    return out


def _telechat3_yarn(params: dict, key: str) -> dict:
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ConfigProblem(
            f"{key} of rope_type telechat3-yarn states factor {factor!r}; state a positive number"
        )
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
    missing = [
        key for key in ("input_mult", "output_mult", "mup_scale_factor") if raw.get(key) is None
    ]
    if missing:
        raise ConfigProblem(
            f"use_mup is set without {', '.join(missing)}; state input_mult, output_mult and "
            "mup_scale_factor, or set use_mup false"
        )
    if not raw["mup_scale_factor"]:
        raise ConfigProblem(
            "mup_scale_factor is 0 under use_mup; the logits are divided by it: state its value"
        )
    return {
        **out,
        "embedding_multiplier": raw["input_mult"],
        "logit_scale": raw["output_mult"] / raw["mup_scale_factor"],
    }


TELECHAT_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "telechat",
        _TELECHAT,
        normalize=_telechat,
        refuse_keys=_TELECHAT_REFUSED,
        parity_reference=_REFERENCE,
    ),
    FamilySpec("telechat3", _LLAMA, normalize=_telechat3, parity_reference=_REFERENCE),
    FamilySpec("TeleFLM", _LLAMA, normalize=_teleflm, parity_reference=_REFERENCE),
)
