"""Zhipu's GLM families, and Sarvam MoE, which Transformers runs as GLM-4-MoE.

- glm: one gate_up_proj, biased query/key/value only, adjacent pairs rotating over half of each
  head.
- glm4 (GLM-4-0414): GLM with a norm over each sublayer's output as well as before it.
- glm4_moe: Llama's names with optional per-head query/key norms, half of each head rotated by
  halves, over DeepSeek-V3's router and shared experts.
- sarvam_moe: Ling 2.0's layout (a fused query_key_value, per-head query/key norms, the router's
  expert_bias) over GLM-4-MoE's router; Glm4MoeForCausalLM is its parity reference.

GLM-4.7-Flash (glm4_moe_lite) is DeepSeek-V3's latent attention and lives in deepseek.py.
"""

from __future__ import annotations

from ster_dist.families.deepseek import DEEPSEEK_V3_ROUTER
from ster_dist.families.layouts import fused_gate_up, fused_qkv, llama_rules
from ster_dist.families.moe_layouts import ROUTER_CORRECTION, deepseek_moe_rules
from ster_dist.families.normalize import biases, stated, switch, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)

# adjacent pairs rotating over half of each head
_GLM_POSITIONS = PositionSpec(interleaved=True, rotary_share=0.5)
_HEAD_QK_NORMS = AttentionSpec(qk_norm=QKNormSpec("head"))
_GLM4_MOE_DEFAULTS = {"first_k_dense_replace": 1, "norm_topk_prob": True}


def _glm(raw: dict) -> dict:
    """Query/key/value biased unless attention_bias says not; the output and the feed-forward
    never."""
    raw = with_defaults(raw, {"head_dim": 128})
    return biases(raw, bool(stated(raw, "attention_bias", default=True)), out=False)


def _glm4_moe(raw: dict) -> dict:
    """attention_bias biases query/key/value only; the query/key norms only under use_qk_norm."""
    raw = with_defaults(raw, _GLM4_MOE_DEFAULTS)
    return {
        **biases(raw, bool(stated(raw, "attention_bias", default=False)), out=False),
        "use_qk_norm": switch(raw, "use_qk_norm"),
    }


def _sarvam_moe(raw: dict) -> dict:
    """Query/key/value biased under attention_bias or use_qkv_bias; the query/key norms on unless
    use_qk_norm says not."""
    raw = with_defaults(
        raw, {**_GLM4_MOE_DEFAULTS, "use_qk_norm": True, "routed_scaling_factor": 2.5}
    )
    return {
        **biases(
            raw, bool(stated(raw, "attention_bias", "use_qkv_bias", default=False)), out=False
        ),
        "use_qk_norm": switch(raw, "use_qk_norm"),
    }


def _glm_rules(post_norms: bool) -> tuple[Rule, ...]:
    extra = (
        dict(post_attn_norm="post_self_attn_layernorm", post_mlp_norm="post_mlp_layernorm")
        if post_norms
        else {}
    )
    return llama_rules(gate=None, up=None, q_norm=None, k_norm=None, **extra) + fused_gate_up(
        "model.layers.{i}.mlp.gate_up_proj"
    )


def ling_rules() -> tuple[Rule, ...]:
    """Ling's layout, which Sarvam MoE and bailing_moe and param2moe (families/ling.py) keep."""
    # Ling 2.0's names: word_embeddings, attention.query_key_value ([q | k | v]), attention.dense,
    # the per-head
    # query_layernorm / key_layernorm and the router's expert_bias
    return (
        llama_rules(
            attn="attention",
            q=None,
            k=None,
            v=None,
            o="dense",
            q_norm="query_layernorm",
            k_norm="key_layernorm",
            embed="word_embeddings",
        )
        + fused_qkv("model.layers.{i}.attention.query_key_value")
        + deepseek_moe_rules()
        + (Rule("model.layers.{i}.mlp.gate.expert_bias", ROUTER_CORRECTION),)
    )


GLM_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "glm",
        _glm_rules(post_norms=False),
        positions=_GLM_POSITIONS,
        normalize=_glm,
        parity_reference="GlmForCausalLM",
    ),
    # GLM-4-0414: GLM with a norm over each sublayer's output as well as before it
    FamilySpec(
        "glm4",
        _glm_rules(post_norms=True),
        norms=NormSpec(post=True),
        positions=_GLM_POSITIONS,
        normalize=_glm,
        parity_reference="Glm4ForCausalLM",
    ),
    FamilySpec(
        "glm4_moe",
        llama_rules() + deepseek_moe_rules(),
        attention=_HEAD_QK_NORMS,
        positions=PositionSpec(rotary_share=0.5),
        normalize=_glm4_moe,
        moe=DEEPSEEK_V3_ROUTER,
        parity_reference="Glm4MoeForCausalLM",
    ),
    FamilySpec(
        "sarvam_moe",
        ling_rules(),
        attention=_HEAD_QK_NORMS,
        positions=PositionSpec(theta=8000000.0),
        normalize=_sarvam_moe,
        moe=DEEPSEEK_V3_ROUTER,
        parity_reference="Glm4MoeForCausalLM",
    ),
)
