"""MosaicML's decoders: names below transformer.blocks, one fused Wqkv, settings nested in
attn_config (and ffn_config), unbiased.

- mpt: ALiBi (attn_config.alibi, on unless stated off) or a learned wpe, LayerNorms without bias, a
  plain up_proj / down_proj feed-forward, a tied head; MPT's other attention options are refused.
- dbrx: MPT's successor: grouped-query attention with clip_qkv under unbiased LayerNorms, over
  softmax experts stored flat (w1 / v1 / w2, all experts in one tensor).
"""

from __future__ import annotations

from ster_dist.families.gpt2 import LAYER_NORM_EPSILON_DEFAULT
from ster_dist.families.layouts import fused_qkv, weight_and_bias
from ster_dist.families.moe_layouts import EXPERTS
from ster_dist.families.normalize import ConfigProblem, never_biased, with_defaults
from ster_dist.families.spec import (
    EmbeddingSpec,
    FamilySpec,
    FeedForwardSpec,
    MoESpec,
    NormSpec,
    PositionSpec,
    Rule,
    Stacked,
)


def _mpt_rules() -> tuple[Rule, ...]:
    b = "transformer.blocks.{i}."
    return (
        Rule("transformer.wte.weight", "embed.weight"),
        Rule("transformer.wpe.weight", "pos_embed.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        *weight_and_bias(f"{b}norm_1", "layers.{i}.attn_norm"),
        *fused_qkv(f"{b}attn.Wqkv", kv_count="heads"),
        *weight_and_bias(f"{b}attn.out_proj", "layers.{i}.attn.o"),
        *weight_and_bias(f"{b}norm_2", "layers.{i}.mlp_norm"),
        *weight_and_bias(f"{b}ffn.up_proj", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{b}ffn.down_proj", "layers.{i}.mlp.down"),
        *weight_and_bias("transformer.norm_f", "final_norm"),
    )


def _dbrx_rules() -> tuple[Rule, ...]:
    block = "transformer.blocks.{i}."
    experts = f"{block}ffn.experts.mlp."
    return (
        Rule("transformer.wte.weight", "embed.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        Rule(f"{block}norm_attn_norm.norm_1.weight", "layers.{i}.attn_norm.weight"),
        *fused_qkv(f"{block}norm_attn_norm.attn.Wqkv"),
        Rule(f"{block}norm_attn_norm.attn.out_proj.weight", "layers.{i}.attn.o.weight"),
        Rule(f"{block}norm_attn_norm.norm_2.weight", "layers.{i}.mlp_norm.weight"),
        Rule(f"{block}ffn.router.layer.weight", "layers.{i}.mlp.router.weight"),
        Rule(f"{experts}w1", Stacked((f"{EXPERTS}gate",), flat=True)),
        Rule(f"{experts}v1", Stacked((f"{EXPERTS}up",), flat=True)),
        Rule(f"{experts}w2", Stacked((f"{EXPERTS}down",), transposed=True, flat=True)),
        Rule("transformer.norm_f.weight", "final_norm.weight"),
    )


def _flattened(raw: dict, *names: str) -> dict:
    """The attention and feed-forward settings MPT and DBRX keep in attn_config / ffn_config, read
    beside the top-level keys (a top-level key wins)."""
    out = dict(raw)
    for name in names:
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise ConfigProblem(f"{name} is not a JSON object; correct it in config.json")
        for key, value in (raw.get(name) or {}).items():
            # ffn_config repeats the width as hidden_size; d_model, at the top, is the one to read
            if out.get(key) is None and key != "hidden_size":
                out[key] = value
    return out


def _mpt(raw: dict) -> dict:
    """ALiBi unless attn_config.alibi says not; no projection biased."""
    return never_biased(
        with_defaults(_flattened(raw, "attn_config"), {**LAYER_NORM_EPSILON_DEFAULT, "alibi": True})
    )


def _dbrx(raw: dict) -> dict:
    """No projection biased; the chosen experts' weights renormalised unless
    moe_normalize_expert_weights says not."""
    defaults = {"layer_norm_eps": 1e-5, "moe_normalize_expert_weights": 1.0}
    out = _flattened(raw, "attn_config", "ffn_config")
    kv = (raw.get("attn_config") or {}).get("kv_n_heads")
    # Transformers' attention reads attn_config's count, not a top-level num_key_value_heads
    if kv is not None:
        out["num_key_value_heads"] = kv
    return never_biased(with_defaults(out, defaults))


_UNBIASED_LAYER_NORMS = NormSpec(kind="layer")

MPT_FAMILIES: tuple[FamilySpec, ...] = (
    # ALiBi (attn_config.alibi, on unless stated off) or a learned wpe; unbiased, with unbiased
    # LayerNorms
    FamilySpec(
        "mpt",
        _mpt_rules(),
        norms=_UNBIASED_LAYER_NORMS,
        feed_forward=FeedForwardSpec(gated=False, activation="gelu"),
        positions=PositionSpec(kind="learned"),
        embedding=EmbeddingSpec(tied=True),
        normalize=_mpt,
        refuse_keys={
            "qk_ln": "query/key norms in MPT's attention are not supported",
            "clip_qkv": "MPT's clip_qkv is not supported",
            "softmax_scale": "MPT's softmax_scale is not supported",
            "logit_scale": "MPT's logit_scale is not supported",
        },
        require_values={
            "attn_type": ("multihead_attention", "only MPT's multi-head attention is supported"),
            "alibi_bias_max": (8, "only alibi_bias_max 8 is supported"),
        },
        parity_reference="MptForCausalLM",
    ),
    FamilySpec(
        "dbrx",
        _dbrx_rules(),
        norms=_UNBIASED_LAYER_NORMS,
        normalize=_dbrx,
        moe=MoESpec(),
        parity_reference="DbrxForCausalLM",
        refuse_keys={
            "tie_word_embeddings": "DBRX's head is never tied to its embedding (Transformers' "
            "DbrxConfig refuses it too); state false"
        },
    ),
)
