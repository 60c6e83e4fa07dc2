"""OLMo 1 and 3, GLM and GLM-4, EXAONE 4, Cohere 2: dense families on the shared decoder."""

from __future__ import annotations

from ster_dist.families.layouts import fused_gate_up, llama_rules
from ster_dist.families.spec import FamilySpec

# OLMo 2's block: no norm before a sublayer, one over each sublayer's output
_POST_NORM_RULES = dict(attn_norm=None, mlp_norm=None, post_attn_norm="post_attention_layernorm",
                        post_mlp_norm="post_feedforward_layernorm")
# GLM: one gate_up_proj, biased query/key/value only, adjacent pairs rotating over half of each head
_GLM = dict(qkv_bias_keys=("attention_bias",), qkv_bias_default=True, o_bias_keys=(), mlp_bias_keys=(),
            rope_interleaved=True, rotary_share=0.5, config_defaults={"head_dim": 128})


def _glm_rules(post_norms: bool):
    extra = dict(post_attn_norm="post_self_attn_layernorm", post_mlp_norm="post_mlp_layernorm") if post_norms else {}
    return (llama_rules(gate=None, up=None, q_norm=None, k_norm=None, **extra)
            + fused_gate_up("model.layers.{i}.mlp.gate_up_proj"))


OLMO_GLM_FAMILIES: tuple[FamilySpec, ...] = (
    # OLMo 1: LayerNorms with neither scale nor bias at Transformers' fixed epsilon; clip_qkv clamps q, k, v
    FamilySpec("olmo", llama_rules(attn_norm=None, mlp_norm=None, q_norm=None, k_norm=None),
               norm_kind="layer", norm_affine=False, norm_eps=1e-5, mlp_bias_keys=(),
               parity_reference="OlmoForCausalLM"),
    # OLMo 3: OLMo 2 with sliding-window layers (every fourth layer full when layer_types is unstated)
    FamilySpec("olmo3", llama_rules(**_POST_NORM_RULES), pre_norm=False, post_norm=True, qk_norm="proj",
               mlp_bias_keys=(), sliding="pattern", local_rope_unscaled=True, default_rope_theta=500_000.0,
               config_defaults={"sliding_window": 4096, "sliding_window_pattern": 4},
               parity_reference="Olmo3ForCausalLM"),
    FamilySpec("glm", _glm_rules(post_norms=False), **_GLM, parity_reference="GlmForCausalLM"),
    # GLM-4-0414: GLM with a norm over each sublayer's output as well as before it
    FamilySpec("glm4", _glm_rules(post_norms=True), post_norm=True, **_GLM, parity_reference="Glm4ForCausalLM"),
    # EXAONE 4: OLMo 2's post-norm block with per-head query/key norms; with a sliding window, full layers
    # apply no rotation
    FamilySpec("exaone4", llama_rules(**_POST_NORM_RULES), pre_norm=False, post_norm=True, qk_norm="head",
               qkv_bias_keys=(), o_bias_keys=(), mlp_bias_keys=(), sliding="pattern", rope_layers="sliding",
               config_defaults={"sliding_window": 4096, "sliding_window_pattern": 4},
               parity_reference="Exaone4ForCausalLM"),
    # Cohere 2 (Command R7B): Cohere's parallel block without query/key norms; only sliding layers rotate
    FamilySpec("cohere2", llama_rules(mlp_norm=None, q_norm=None, k_norm=None), norm_kind="layer",
               parallel_block=True, rope_interleaved=True, tied_default=True, o_bias_keys=("attention_bias",),
               mlp_bias_keys=(), sliding="pattern", rope_layers="sliding",
               config_defaults={"sliding_window": 4096, "sliding_window_pattern": 4},
               parity_reference="Cohere2ForCausalLM"),
)
