"""Groups of FamilySpec switches that families of several lineages set together (keyword dicts)."""

from __future__ import annotations

# every projection biased, with no config key to turn the biases off (GPT-2, BLOOM, Phi)
ALWAYS_BIASED = dict(qkv_bias_keys=(), qkv_bias_default=True, o_bias_keys=(), o_bias_default=True,
                     mlp_bias_keys=(), mlp_bias_default=True)
# no projection biased, whatever the config says (Gemma, Phi-3, MPT)
NEVER_BIASED = dict(qkv_bias_keys=(), o_bias_keys=(), mlp_bias_keys=())
# the GPT-2 era's block: biased LayerNorms and a feed-forward without a gate
BIASED_LAYER_NORM_PLAIN_MLP = dict(norm_kind="layer", norm_bias=True, mlp_gated=False)
# what the GPT-2 era's config classes assume where a config states no epsilon
LAYER_NORM_EPSILON_DEFAULT = {"layer_norm_epsilon": 1e-5}
