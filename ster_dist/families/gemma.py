"""Gemma and its descendants: RMS norms stored as an offset from one, the embedding scaled by
sqrt(hidden), a tied head and no biases.

- gemma: Llama's names with a GELU-tanh gated feed-forward.
- gemma2: a norm over each sublayer's output as well as before it, every other layer sliding,
  soft-capped scores and logits.
- gemma3_text: Gemma 2 with per-head query/key norms, sliding layers by pattern and a local rotation
  base of their own; image-text configs leave most of text_config to Gemma3TextConfig's defaults.
- vaultgemma: Gemma 2 without the norms over each sublayer's output.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.normalize import never_biased, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    FeedForwardSpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
)

# RMS norms stored as an offset from one (Gemma 2 and 3: over each sublayer's output too), the
# embedding scaled
# by sqrt(hidden), a tied head
_NORMS = NormSpec(offset=1.0)
_GEMMA2_NORMS = NormSpec(offset=1.0, post=True)
_EMBEDDING = EmbeddingSpec(tied=True, scale_sqrt=True)
# Gemma 3's image-text configs leave most of text_config to Gemma3TextConfig's defaults
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}
_VAULTGEMMA_DEFAULTS = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
_GEMMA2_RULES = llama_rules(
    mlp_norm="pre_feedforward_layernorm",
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    q_norm="q_norm",
    k_norm="k_norm",
)

GEMMA_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "gemma",
        llama_rules(q_norm=None, k_norm=None),
        feed_forward=FeedForwardSpec(activation="gelu_pytorch_tanh"),
        norms=_NORMS,
        embedding=_EMBEDDING,
        normalize=never_biased,
        parity_reference="GemmaForCausalLM",
    ),
    FamilySpec(
        "gemma2",
        _GEMMA2_RULES,
        attention=AttentionSpec(sliding="even"),
        norms=_GEMMA2_NORMS,
        embedding=_EMBEDDING,
        normalize=never_biased,
        parity_reference="Gemma2ForCausalLM",
    ),
    FamilySpec(
        "gemma3_text",
        _GEMMA2_RULES,
        attention=AttentionSpec(sliding="pattern", qk_norm=QKNormSpec("head")),
        norms=_GEMMA2_NORMS,
        embedding=_EMBEDDING,
        positions=PositionSpec(theta=1_000_000.0, local_theta=10_000.0),
        normalize=lambda raw: never_biased(with_defaults(raw, _GEMMA3_TEXT_DEFAULTS)),
        parity_reference="Gemma3ForCausalLM",
    ),
    # Gemma 2 without the norms over each sublayer's output
    FamilySpec(
        "vaultgemma",
        llama_rules(mlp_norm="pre_feedforward_layernorm", q_norm=None, k_norm=None),
        attention=AttentionSpec(sliding="even"),
        norms=_NORMS,
        embedding=_EMBEDDING,
        normalize=lambda raw: never_biased(with_defaults(raw, _VAULTGEMMA_DEFAULTS)),
        parity_reference="VaultGemmaForCausalLM",
    ),
)
