"""EleutherAI's rotary decoders and StableLM, which grew from GPT-NeoX: LayerNorms, a plain feed-forward, a
parallel residual, part of each head rotated.

- gptj: one norm before a parallel block, unbiased attention, adjacent pairs rotating over rotary_dim, a biased
  head, names below transformer.h.
- gpt_neox: a parallel block with a norm per branch (use_parallel_residual, sequential when off), one
  query_key_value tensor grouped head by head, a quarter of each head rotated unless stated.
- stablelm: Llama's names under LayerNorms, GPT-NeoX's use_parallel_residual and quarter rotation, optional
  per-head LayerNorm query/key norms stored one tensor per head.
"""

from __future__ import annotations

from ster_dist.families.layouts import fused_qkv, llama_rules, weight_and_bias
from ster_dist.families.spec import FamilySpec, Rule
from ster_dist.families.switches import BIASED_LAYER_NORM_PLAIN_MLP, LAYER_NORM_EPSILON_DEFAULT


def _gptj_rules() -> tuple[Rule, ...]:
    h = "transformer.h.{i}."
    return (
        Rule("transformer.wte.weight", "embed.weight"), *weight_and_bias("lm_head", "lm_head"),
        *weight_and_bias(f"{h}ln_1", "layers.{i}.attn_norm"),
        *(Rule(f"{h}attn.{src}.weight", f"layers.{{i}}.attn.{dst}.weight")
          for src, dst in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o"))),
        *weight_and_bias(f"{h}mlp.fc_in", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{h}mlp.fc_out", "layers.{i}.mlp.down"),
        *weight_and_bias("transformer.ln_f", "final_norm"),
    )


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


GPTJ_NEOX_FAMILIES: tuple[FamilySpec, ...] = (
    # one norm before a parallel block, unbiased attention, adjacent pairs rotating over rotary_dim, biased head
    FamilySpec("gptj", _gptj_rules(), optional_prefix="transformer.",
               ignore=(r".*\.attn\.(masked_)?bias$", r"transformer\.bias$"), **BIASED_LAYER_NORM_PLAIN_MLP,
               parallel_block=True, rope_interleaved=True, lm_head_bias=True, qkv_bias_keys=(), o_bias_keys=(),
               mlp_bias_keys=(), mlp_bias_default=True,
               config_defaults={**LAYER_NORM_EPSILON_DEFAULT, "activation_function": "gelu_new"},
               parity_reference="GPTJForCausalLM"),
    FamilySpec("gpt_neox", _gpt_neox_rules(), ignore=(r".*\.attention\.(masked_)?bias$",),
               norm_kind="layer", norm_bias=True, parallel_key="use_parallel_residual", parallel_shared_norm=False,
               mlp_gated=False, qkv_bias_keys=("attention_bias",), qkv_bias_default=True,
               o_bias_keys=("attention_bias",), o_bias_default=True, mlp_bias_keys=(), mlp_bias_default=True,
               config_defaults={"use_parallel_residual": True}, rotary_share=0.25,
               parity_reference="GPTNeoXForCausalLM"),
    FamilySpec("stablelm", _stablelm_rules(), norm_kind="layer", norm_bias=True, parallel_key="use_parallel_residual",
               qk_norm="head", qk_norm_key="qk_layernorm", qk_norm_kind="layer", qk_norm_per_head_weight=True,
               qkv_bias_keys=("use_qkv_bias",), o_bias_keys=(), mlp_bias_keys=(), rotary_share=0.25,
               parity_reference="StableLmForCausalLM"),
)
