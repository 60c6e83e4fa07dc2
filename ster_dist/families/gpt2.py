"""GPT-2 and GPT-BigCode: learned positions, biased LayerNorms, one fused c_attn, a plain c_fc / c_proj
feed-forward, a tied head, everything biased.

- gpt2: the layout stored inputs-first (Conv1D); attention scaled by the inverse layer index is refused.
- gpt_bigcode (StarCoder 1, SantaCoder): GPT-2's block with ordinary linear weights; c_attn grouped by key-value
  head (one when multi_query).

StarCoder2 follows Mistral's classes and lives in llama.py.
"""

from __future__ import annotations

from ster_dist.families.layouts import QKV_PER_KV_GROUP, gpt2_rules
from ster_dist.families.spec import FamilySpec
from ster_dist.families.switches import (
    ALWAYS_BIASED,
    BIASED_LAYER_NORM_PLAIN_MLP,
    LAYER_NORM_EPSILON_DEFAULT,
)

# the causal-mask buffers older checkpoints saved beside the weights
_BUFFERS = (r".*\.attn\.(masked_)?bias$", r"transformer\.bias$")

GPT2_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("gpt2", gpt2_rules(transposed=True, kv_count="heads"), optional_prefix="transformer.",
               ignore=(r".*\.attn\.(masked_)?bias$",), **BIASED_LAYER_NORM_PLAIN_MLP, positions="learned",
               tied_default=True, **ALWAYS_BIASED,
               refuse_keys={"scale_attn_by_inverse_layer_idx":
                            "ster_dist does not run GPT-2 attention scaled by the inverse layer index"},
               parity_reference="GPT2LMHeadModel"),
    # GPT-2's block with ordinary linear weights; c_attn grouped by key-value head (one when multi_query)
    FamilySpec("gpt_bigcode", gpt2_rules(transposed=False, **QKV_PER_KV_GROUP), optional_prefix="transformer.",
               ignore=_BUFFERS, **BIASED_LAYER_NORM_PLAIN_MLP, positions="learned", tied_default=True,
               **ALWAYS_BIASED, config_defaults={**LAYER_NORM_EPSILON_DEFAULT,
                                                 "activation_function": "gelu_pytorch_tanh"},
               parity_reference="GPTBigCodeForCausalLM"),
)
