"""Dense families that are Llama's block with a few conventions changed (Nemotron, Arcee, Seed-OSS, ERNIE 4.5,
HunYuan dense, Ministral 3, VaultGemma).

InternLM3 has no spec: the installed Transformers ships only its config class, so there is no reference to check
parity against.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.spec import FamilySpec

_LLAMA = llama_rules(q_norm=None, k_norm=None)
# a plain feed-forward: down(act(up(x))), squared ReLU unless the config says otherwise
_PLAIN = llama_rules(gate=None, q_norm=None, k_norm=None)
# what Transformers' config classes assume where a config is silent
_MINISTRAL3_DEFAULTS = {
    "head_dim": 128, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                        "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1},
}
_VAULTGEMMA_DEFAULTS = {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                        "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

LLAMA_VARIANT_FAMILIES: tuple[FamilySpec, ...] = (
    # LayerNorm1P: a biased LayerNorm whose scale is stored as an offset from one; half of each head rotates
    FamilySpec("nemotron", _PLAIN, norm_kind="layer", norm_bias=True, norm_offset=1.0, mlp_gated=False,
               rotary_share=0.5, config_defaults={"hidden_act": "relu2", "norm_eps": 1e-5},
               parity_reference="NemotronForCausalLM"),
    FamilySpec("arcee", _PLAIN, mlp_gated=False, config_defaults={"hidden_act": "relu2", "rms_norm_eps": 1e-5},
               parity_reference="ArceeForCausalLM"),
    # biased query/key/value by default; the output's bias has its own key
    FamilySpec("seed_oss", _LLAMA, qkv_bias_default=True, o_bias_keys=("attention_out_bias",),
               config_defaults={"head_dim": 128, "num_key_value_heads": 8}, parity_reference="SeedOssForCausalLM"),
    FamilySpec("ernie4_5", _LLAMA, rope_interleaved=True, tied_default=True, default_rope_theta=500000.0,
               qkv_bias_keys=("use_bias",), o_bias_keys=("use_bias",), mlp_bias_keys=("use_bias",),
               config_defaults={"head_dim": 128, "num_key_value_heads": 2, "rms_norm_eps": 1e-5},
               parity_reference="Ernie4_5ForCausalLM"),
    # per-head query/key norms applied after the rotation; Transformers always builds them, so unstated is on
    FamilySpec("hunyuan_v1_dense", llama_rules(q_norm="query_layernorm", k_norm="key_layernorm"),
               qk_norm="head", qk_norm_key="use_qk_norm", qk_norm_after_rope=True,
               config_defaults={"use_qk_norm": True, "rms_norm_eps": 1e-5},
               refuse_keys={"use_cla": "cross-layer attention (keys and values shared between layers) is not "
                                       "supported",
                            "use_mla": "HunYuan's latent attention is not supported"},
               parity_reference="HunYuanDenseV1ForCausalLM"),
    # Mistral's block with Llama 4's query temperature (rope_parameters' llama_4_scaling_beta)
    FamilySpec("ministral3", _LLAMA, sliding="all", query_temperature=True, config_defaults=_MINISTRAL3_DEFAULTS,
               parity_reference="Ministral3ForCausalLM"),
    # Gemma 2 without the norms over each sublayer's output
    FamilySpec("vaultgemma", llama_rules(mlp_norm="pre_feedforward_layernorm", q_norm=None, k_norm=None),
               sliding="even", norm_offset=1.0, embed_scale_sqrt=True, tied_default=True, qkv_bias_keys=(),
               o_bias_keys=(), mlp_bias_keys=(), config_defaults=_VAULTGEMMA_DEFAULTS,
               parity_reference="VaultGemmaForCausalLM"),
)
