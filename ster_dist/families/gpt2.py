"""GPT-2 and GPT-BigCode: learned positions, biased LayerNorms, one fused c_attn, a plain c_fc /
c_proj feed-forward, a tied head, everything biased.

- gpt2: the layout stored inputs-first (Conv1D); attention scaled by the inverse layer index is
  refused.
- gpt_bigcode (StarCoder 1, SantaCoder): GPT-2's block with ordinary linear weights; c_attn grouped
  by key-value head (one when multi_query).

StarCoder2 follows Mistral's classes and lives in llama.py.
"""

from __future__ import annotations

from ster_dist.families.layouts import QKV_PER_KV_GROUP, gpt2_rules
from ster_dist.families.normalize import always_biased, with_defaults
from ster_dist.families.spec import (
    EmbeddingSpec,
    FamilySpec,
    FeedForwardSpec,
    NormSpec,
    PositionSpec,
)

# The GPT-2 era's block, which GPT-J, BLOOM, Falcon and OPT keep: biased LayerNorms and a
# feed-forward without a gate
BIASED_LAYER_NORMS = NormSpec(kind="layer", bias=True)
PLAIN_FEED_FORWARD = FeedForwardSpec(gated=False)
# what the GPT-2 era's config classes assume where a config states no epsilon
LAYER_NORM_EPSILON_DEFAULT = {"layer_norm_epsilon": 1e-5}
# the causal-mask buffers older checkpoints saved beside the weights
_BUFFERS = (r".*\.attn\.(masked_)?bias$", r"transformer\.bias$")
_GPT2 = dict(
    norms=BIASED_LAYER_NORMS,
    feed_forward=PLAIN_FEED_FORWARD,
    positions=PositionSpec(kind="learned"),
    embedding=EmbeddingSpec(tied=True),
    optional_prefix="transformer.",
)

GPT2_FAMILIES: tuple[FamilySpec, ...] = (
    # every projection biased
    FamilySpec(
        "gpt2",
        gpt2_rules(transposed=True, kv_count="heads"),
        **_GPT2,
        ignore=(r".*\.attn\.(masked_)?bias$",),
        normalize=always_biased,
        refuse_keys={
            "scale_attn_by_inverse_layer_idx": "ster_dist does not run GPT-2 attention scaled by the inverse layer index"
        },
        parity_reference="GPT2LMHeadModel",
    ),
    # GPT-2's block with ordinary linear weights; c_attn grouped by key-value head (one when
    # multi_query)
    FamilySpec(
        "gpt_bigcode",
        gpt2_rules(transposed=False, **QKV_PER_KV_GROUP),
        **_GPT2,
        ignore=_BUFFERS,
        normalize=lambda raw: always_biased(
            with_defaults(
                raw, {**LAYER_NORM_EPSILON_DEFAULT, "activation_function": "gelu_pytorch_tanh"}
            )
        ),
        parity_reference="GPTBigCodeForCausalLM",
    ),
)
