"""The dense rotary and learned-position families: one FamilySpec each."""

from __future__ import annotations

from ster_dist.families.layouts import (
    fused_gate_up,
    fused_qkv,
    gpt2_rules,
    llama_rules,
    weight_and_bias,
)
from ster_dist.families.spec import FamilySpec, Rule

_LLAMA = llama_rules(q_norm=None, k_norm=None)
_NO_BIAS = dict(qkv_bias_keys=(), o_bias_keys=(), mlp_bias_keys=())
_ALL_BIAS = dict(qkv_bias_keys=(), qkv_bias_default=True, o_bias_keys=(), o_bias_default=True,
                 mlp_bias_keys=(), mlp_bias_default=True)

_GEMMA = dict(norm_offset=1.0, embed_scale_sqrt=True, tied_default=True, **_NO_BIAS)
# Gemma 3's image-text configs leave most of text_config to Gemma3TextConfig's defaults
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6,
}
_GEMMA2_RULES = llama_rules(mlp_norm="pre_feedforward_layernorm", post_attn_norm="post_attention_layernorm",
                            post_mlp_norm="post_feedforward_layernorm", q_norm="q_norm", k_norm="k_norm")


def _gpt_neox_rules() -> tuple[Rule, ...]:
    layer = "gpt_neox.layers.{i}."
    return (
        Rule("gpt_neox.embed_in.weight", "embed.weight"),
        Rule("embed_out.weight", "lm_head.weight"), Rule("lm_head.weight", "lm_head.weight"),
        *weight_and_bias(f"{layer}input_layernorm", "layers.{i}.attn_norm"),
        *weight_and_bias(f"{layer}post_attention_layernorm", "layers.{i}.mlp_norm"),
        *fused_qkv(f"{layer}attention.query_key_value", groups="heads", q_count="one", kv_count="one"),
        *weight_and_bias(f"{layer}attention.dense", "layers.{i}.attn.o"),
        *weight_and_bias(f"{layer}mlp.dense_h_to_4h", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{layer}mlp.dense_4h_to_h", "layers.{i}.mlp.down"),
        *weight_and_bias("gpt_neox.final_layer_norm", "final_norm"),
    )


def _stablelm_rules() -> tuple[Rule, ...]:
    per_head = tuple(Rule(f"model.layers.{{i}}.self_attn.{src}_layernorm.norms.{{h}}.weight",
                          f"layers.{{i}}.attn.{src}_norm.weight") for src in ("q", "k"))
    return llama_rules(q_norm=None, k_norm=None) + per_head


DENSE_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("llama", _LLAMA, parity_reference="LlamaForCausalLM"),
    FamilySpec("mistral", _LLAMA, sliding="all", parity_reference="MistralForCausalLM"),
    FamilySpec("qwen2", _LLAMA, sliding="max_window_layers", qkv_bias_keys=(), qkv_bias_default=True,
               o_bias_keys=(), mlp_bias_keys=(), parity_reference="Qwen2ForCausalLM"),
    FamilySpec("qwen3", llama_rules(), sliding="max_window_layers", qk_norm="head", o_bias_keys=(),
               mlp_bias_keys=(), parity_reference="Qwen3ForCausalLM"),
    FamilySpec("gemma", _LLAMA, activation="gelu_pytorch_tanh", **_GEMMA, parity_reference="GemmaForCausalLM"),
    FamilySpec("gemma2", _GEMMA2_RULES, post_norm=True, sliding="even", **_GEMMA,
               parity_reference="Gemma2ForCausalLM"),
    FamilySpec("gemma3_text", _GEMMA2_RULES, post_norm=True, sliding="pattern", qk_norm="head", **_GEMMA,
               default_rope_theta=1_000_000.0, default_local_rope_theta=10_000.0,
               config_defaults=_GEMMA3_TEXT_DEFAULTS, parity_reference="Gemma3ForCausalLM"),
    FamilySpec("phi", llama_rules(o="dense", gate=None, up="fc1", down="fc2", mlp_norm=None,
                                  final_norm="final_layernorm", q_norm="q_layernorm", k_norm="k_layernorm"),
               norm_kind="layer", norm_bias=True, parallel_block=True, mlp_gated=False, lm_head_bias=True,
               qk_norm="head", qk_norm_key="qk_layernorm", qk_norm_kind="layer", qk_norm_bias=True,
               **_ALL_BIAS, rotary_share=0.5, parity_reference="PhiForCausalLM"),
    FamilySpec("phi3", llama_rules(q=None, k=None, v=None, gate=None, up=None, q_norm=None, k_norm=None)
               + fused_qkv("model.layers.{i}.self_attn.qkv_proj") + fused_gate_up("model.layers.{i}.mlp.gate_up_proj"),
               sliding="all", **_NO_BIAS, parity_reference="Phi3ForCausalLM"),
    FamilySpec("granite", _LLAMA, parity_reference="GraniteForCausalLM"),
    FamilySpec("stablelm", _stablelm_rules(), norm_kind="layer", norm_bias=True, parallel_key="use_parallel_residual",
               qk_norm="head", qk_norm_key="qk_layernorm", qk_norm_kind="layer", qk_norm_per_head_weight=True,
               qkv_bias_keys=("use_qkv_bias",), o_bias_keys=(), mlp_bias_keys=(), rotary_share=0.25,
               parity_reference="StableLmForCausalLM"),
    FamilySpec("starcoder2", llama_rules(gate=None, up="c_fc", down="c_proj", q_norm=None, k_norm=None),
               norm_kind="layer", norm_bias=True, mlp_gated=False, sliding="all", tied_default=True,
               qkv_bias_keys=("use_bias",), o_bias_keys=("use_bias",), mlp_bias_keys=("use_bias",),
               parity_reference="Starcoder2ForCausalLM"),
    FamilySpec("cohere", llama_rules(mlp_norm=None), norm_kind="layer", parallel_block=True, rope_interleaved=True,
               qk_norm="head", qk_norm_key="use_qk_norm", qk_norm_kind="layer", qk_norm_per_head_weight=True,
               tied_default=True, o_bias_keys=("attention_bias",), mlp_bias_keys=(),
               parity_reference="CohereForCausalLM"),
    FamilySpec("olmo2", llama_rules(attn_norm=None, mlp_norm=None, post_attn_norm="post_attention_layernorm",
                                    post_mlp_norm="post_feedforward_layernorm"),
               pre_norm=False, post_norm=True, qk_norm="proj", mlp_bias_keys=(),
               parity_reference="Olmo2ForCausalLM"),
    FamilySpec("gpt2", gpt2_rules(transposed=True, kv_count="heads"), optional_prefix="transformer.", ignore=(r".*\.attn\.(masked_)?bias$",),
               norm_kind="layer", norm_bias=True, positions="learned", mlp_gated=False, tied_default=True,
               **_ALL_BIAS, refuse_keys={"scale_attn_by_inverse_layer_idx":
                                         "ster_dist does not run GPT-2 attention scaled by the inverse layer index"},
               parity_reference="GPT2LMHeadModel"),
    FamilySpec("gpt_neox", _gpt_neox_rules(), ignore=(r".*\.attention\.(masked_)?bias$",),
               norm_kind="layer", norm_bias=True, parallel_key="use_parallel_residual", parallel_shared_norm=False,
               mlp_gated=False, qkv_bias_keys=("attention_bias",), qkv_bias_default=True,
               o_bias_keys=("attention_bias",), o_bias_default=True, mlp_bias_keys=(), mlp_bias_default=True,
               config_defaults={"use_parallel_residual": True}, rotary_share=0.25,
               parity_reference="GPTNeoXForCausalLM"),
    FamilySpec("smollm3", _LLAMA, sliding="max_window_layers", tied_default=True,
               parity_reference="SmolLM3ForCausalLM"),
)
