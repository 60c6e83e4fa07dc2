"""BLOOM and Falcon, which kept BLOOM's names: biased LayerNorms, one self_attention.query_key_value
tensor grouped by key-value head, a plain dense_h_to_4h / dense_4h_to_h feed-forward, ALiBi or
rotation.

- bloom: ALiBi in place of rotation, a norm after the embedding, every projection biased; residuals
  taken after the norm are refused.
- falcon: all three layouts: the new decoder architecture (grouped key-value heads, ln_attn and
  ln_mlp before a parallel block), Falcon-7B (multi-query, one norm before a parallel block) and
  Falcon-RW (ALiBi added before the scores are scaled, in bf16, sequential blocks); `bias` switches
  every projection's bias.
"""

from __future__ import annotations

from ster_dist.families.gpt2 import (
    BIASED_LAYER_NORMS,
    LAYER_NORM_EPSILON_DEFAULT,
)
from ster_dist.families.layouts import QKV_PER_KV_GROUP, fused_qkv, weight_and_bias
from ster_dist.families.normalize import (
    KV_HEAD_KEYS,
    always_biased,
    biases_from,
    stated,
    switch,
    with_defaults,
)
from ster_dist.families.spec import (
    EmbeddingSpec,
    FamilySpec,
    FeedForwardSpec,
    NormSpec,
    PositionSpec,
    Rule,
)


def _bloom_falcon_rules(embed_norm: bool) -> tuple[Rule, ...]:
    """BLOOM's names; Falcon's are the same without the embedding norm, with ln_attn / ln_mlp in its
    new architecture."""
    h = "transformer.h.{i}."
    extra = (
        weight_and_bias("transformer.word_embeddings_layernorm", "embed_norm")
        if embed_norm
        else (
            *weight_and_bias(f"{h}ln_attn", "layers.{i}.attn_norm"),
            *weight_and_bias(f"{h}ln_mlp", "layers.{i}.mlp_norm"),
        )
    )
    return (
        Rule("transformer.word_embeddings.weight", "embed.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        *extra,
        *weight_and_bias(f"{h}input_layernorm", "layers.{i}.attn_norm"),
        *weight_and_bias(f"{h}post_attention_layernorm", "layers.{i}.mlp_norm"),
        *fused_qkv(f"{h}self_attention.query_key_value", **QKV_PER_KV_GROUP),
        *weight_and_bias(f"{h}self_attention.dense", "layers.{i}.attn.o"),
        *weight_and_bias(f"{h}mlp.dense_h_to_4h", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{h}mlp.dense_4h_to_h", "layers.{i}.mlp.down"),
        *weight_and_bias("transformer.ln_f", "final_norm"),
    )


def _falcon(raw: dict) -> dict:
    """`bias` switches every projection, parallel_attn the parallel block. The new decoder
    architecture reads the stated key-value head count and gives each half of the block its own norm
    unless num_ln_in_parallel_attn is 1; the older layouts have one key-value head under
    multi_query, else one per head, and one norm."""
    raw = with_defaults(
        raw, {**LAYER_NORM_EPSILON_DEFAULT, "multi_query": True, "parallel_attn": True}
    )
    new = switch(raw, "new_decoder_architecture")
    out = {
        **biases_from(raw, "bias"),
        "use_parallel_residual": switch(raw, "parallel_attn"),
        "num_ln_in_parallel_attn": 1
        if not new or stated(raw, "num_ln_in_parallel_attn") == 1
        else 2,
    }
    # Transformers' attention reads num_kv_heads (num_key_value_heads is its config's derived copy)
    if new:
        kv = raw.get("num_kv_heads")
        return {
            **out,
            "multi_query": False,
            **({"num_key_value_heads": kv} if kv is not None else {}),
        }
    return {**out, **dict.fromkeys(KV_HEAD_KEYS)}


_FALCON_FEED_FORWARD = FeedForwardSpec(gated=False, activation="gelu")

BLOOM_FALCON_FAMILIES: tuple[FamilySpec, ...] = (
    # ALiBi in place of rotation, a norm after the embedding, every projection biased
    FamilySpec(
        "bloom",
        _bloom_falcon_rules(embed_norm=True),
        optional_prefix="transformer.",
        norms=NormSpec(kind="layer", bias=True, embed=True),
        feed_forward=FeedForwardSpec(gated=False, activation="gelu_pytorch_tanh"),
        positions=PositionSpec(kind="alibi"),
        embedding=EmbeddingSpec(tied=True),
        normalize=lambda raw: always_biased(with_defaults(raw, LAYER_NORM_EPSILON_DEFAULT)),
        refuse_keys={
            "apply_residual_connection_post_layernorm": "residuals taken after the norm are not supported"
        },
        parity_reference="BloomForCausalLM",
    ),
    # parallel blocks (parallel_attn), two norms in the new architecture, grouped key-value heads
    # there and one
    # under multi_query; alibi replaces rotation, added before the scores are scaled
    FamilySpec(
        "falcon",
        _bloom_falcon_rules(embed_norm=False),
        optional_prefix="transformer.",
        norms=BIASED_LAYER_NORMS,
        feed_forward=_FALCON_FEED_FORWARD,
        positions=PositionSpec(alibi_before_scale=True, alibi_bf16=True),
        embedding=EmbeddingSpec(tied=True),
        normalize=_falcon,
        parity_reference="FalconForCausalLM",
    ),
)
