"""Older architectures: learned or ALiBi positions, multi-query and parallel attention (GPT-J, GPT-BigCode, OPT, Falcon, BLOOM, MPT)."""

from __future__ import annotations

from ster_dist.families.layouts import fused_qkv, gpt2_rules, weight_and_bias
from ster_dist.families.spec import FamilySpec, Rule

_LAYER_NORM = dict(norm_kind="layer", norm_bias=True, mlp_gated=False)
_ALL_BIAS = dict(qkv_bias_keys=(), qkv_bias_default=True, o_bias_keys=(), o_bias_default=True,
                 mlp_bias_keys=(), mlp_bias_default=True)
# query, key and value rows grouped by key-value head: each group that head's queries, then its key and value.
# With one key-value head this is all queries, then the key and the value (multi-query); with one per head it
# is each head's query, key and value in turn (BLOOM, Falcon without multi_query, GPT-BigCode without it).
_PER_KV_GROUP = dict(groups="kv_heads", q_count="heads_per_kv", kv_count="one")


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


def _opt_rules() -> tuple[Rule, ...]:
    d, layer = "model.decoder.", "model.decoder.layers.{i}."
    return (
        Rule(f"{d}embed_tokens.weight", "embed.weight"), Rule(f"{d}embed_positions.weight", "pos_embed.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        *(rule for src, dst in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o"))
          for rule in weight_and_bias(f"{layer}self_attn.{src}", f"layers.{{i}}.attn.{dst}")),
        *weight_and_bias(f"{layer}self_attn_layer_norm", "layers.{i}.attn_norm"),
        *weight_and_bias(f"{layer}final_layer_norm", "layers.{i}.mlp_norm"),
        *weight_and_bias(f"{layer}fc1", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{layer}fc2", "layers.{i}.mlp.down"),
        *weight_and_bias(f"{d}final_layer_norm", "final_norm"),
    )


def _bloom_falcon_rules(embed_norm: bool) -> tuple[Rule, ...]:
    """BLOOM's names; Falcon's are the same without the embedding norm, with ln_attn / ln_mlp in its new
    architecture."""
    h = "transformer.h.{i}."
    extra = weight_and_bias("transformer.word_embeddings_layernorm", "embed_norm") if embed_norm else (
        *weight_and_bias(f"{h}ln_attn", "layers.{i}.attn_norm"), *weight_and_bias(f"{h}ln_mlp", "layers.{i}.mlp_norm"))
    return (
        Rule("transformer.word_embeddings.weight", "embed.weight"), Rule("lm_head.weight", "lm_head.weight"),
        *extra,
        *weight_and_bias(f"{h}input_layernorm", "layers.{i}.attn_norm"),
        *weight_and_bias(f"{h}post_attention_layernorm", "layers.{i}.mlp_norm"),
        *fused_qkv(f"{h}self_attention.query_key_value", **_PER_KV_GROUP),
        *weight_and_bias(f"{h}self_attention.dense", "layers.{i}.attn.o"),
        *weight_and_bias(f"{h}mlp.dense_h_to_4h", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{h}mlp.dense_4h_to_h", "layers.{i}.mlp.down"),
        *weight_and_bias("transformer.ln_f", "final_norm"),
    )


def _mpt_rules() -> tuple[Rule, ...]:
    b = "transformer.blocks.{i}."
    return (
        Rule("transformer.wte.weight", "embed.weight"), Rule("transformer.wpe.weight", "pos_embed.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        *weight_and_bias(f"{b}norm_1", "layers.{i}.attn_norm"),
        *fused_qkv(f"{b}attn.Wqkv", kv_count="heads"),
        *weight_and_bias(f"{b}attn.out_proj", "layers.{i}.attn.o"),
        *weight_and_bias(f"{b}norm_2", "layers.{i}.mlp_norm"),
        *weight_and_bias(f"{b}ffn.up_proj", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{b}ffn.down_proj", "layers.{i}.mlp.down"),
        *weight_and_bias("transformer.norm_f", "final_norm"),
    )


_BIAS_KEY = dict(qkv_bias_keys=("bias",), o_bias_keys=("bias",), mlp_bias_keys=("bias",))
_OPT_BIAS = dict(qkv_bias_keys=("enable_bias",), qkv_bias_default=True, o_bias_keys=("enable_bias",),
                 o_bias_default=True, mlp_bias_keys=("enable_bias",), mlp_bias_default=True)
_NO_BIAS = dict(qkv_bias_keys=(), o_bias_keys=(), mlp_bias_keys=())
_BUFFERS = (r".*\.attn\.(masked_)?bias$", r"transformer\.bias$")
_EPS = {"layer_norm_epsilon": 1e-5}  # what the config classes assume where a config is silent

CLASSIC_FAMILIES: tuple[FamilySpec, ...] = (
    # one norm before a parallel block, unbiased attention, adjacent pairs rotating over rotary_dim, biased head
    FamilySpec("gptj", _gptj_rules(), optional_prefix="transformer.", ignore=_BUFFERS, **_LAYER_NORM,
               parallel_block=True, rope_interleaved=True, lm_head_bias=True, qkv_bias_keys=(), o_bias_keys=(),
               mlp_bias_keys=(), mlp_bias_default=True,
               config_defaults={**_EPS, "activation_function": "gelu_new"}, parity_reference="GPTJForCausalLM"),
    # GPT-2's block with ordinary linear weights; c_attn grouped by key-value head (one when multi_query)
    FamilySpec("gpt_bigcode", gpt2_rules(transposed=False, **_PER_KV_GROUP), optional_prefix="transformer.", ignore=_BUFFERS, **_LAYER_NORM,
               positions="learned", tied_default=True, **_ALL_BIAS,
               config_defaults={**_EPS, "activation_function": "gelu_pytorch_tanh"},
               parity_reference="GPTBigCodeForCausalLM"),
    # learned positions read two rows in, enable_bias on every projection, LayerNorms at Transformers' epsilon
    FamilySpec("opt", _opt_rules(), optional_prefix="model.", **_LAYER_NORM, norm_eps=1e-5, positions="learned",
               position_offset=2, tied_default=True, **_OPT_BIAS, width_keys=("word_embed_proj_dim",),
               config_defaults={"activation_function": "relu"},
               require_values={
                   "do_layer_norm_before": (True, "OPT's post-norm blocks are not supported"),
                   "_remove_final_layer_norm": (False, "OPT without its final norm is not supported"),
                   "layer_norm_elementwise_affine": (True, "OPT's norms without scale and bias are not supported")},
               parity_reference="OPTForCausalLM"),
    # parallel blocks (parallel_attn), two norms in the new architecture, grouped key-value heads there and one
    # under multi_query; alibi replaces rotation, added before the scores are scaled
    FamilySpec("falcon", _bloom_falcon_rules(embed_norm=False), optional_prefix="transformer.", **_LAYER_NORM,
               parallel_key="parallel_attn", parallel_norms_key="new_decoder_architecture",
               grouped_kv_key="new_decoder_architecture", alibi_key="alibi", alibi_before_scale=True,
               alibi_bf16=True, activation="gelu", tied_default=True, **_BIAS_KEY,
               config_defaults={**_EPS, "multi_query": True, "parallel_attn": True},
               parity_reference="FalconForCausalLM"),
    FamilySpec("bloom", _bloom_falcon_rules(embed_norm=True), optional_prefix="transformer.", **_LAYER_NORM,
               positions="alibi", embed_norm=True, activation="gelu_pytorch_tanh", tied_default=True, **_ALL_BIAS,
               config_defaults=_EPS,
               refuse_keys={"apply_residual_connection_post_layernorm":
                            "residuals taken after the norm are not supported"},
               parity_reference="BloomForCausalLM"),
    # ALiBi (attn_config.alibi, on unless stated off) or a learned wpe; unbiased, with unbiased LayerNorms
    FamilySpec("mpt", _mpt_rules(), norm_kind="layer", mlp_gated=False, positions="learned", alibi_key="alibi",
               activation="gelu", tied_default=True, **_NO_BIAS, nested_configs=("attn_config",),
               config_defaults={**_EPS, "alibi": True},
               refuse_keys={"qk_ln": "query/key norms in MPT's attention are not supported",
                            "clip_qkv": "MPT's clip_qkv is not supported",
                            "softmax_scale": "MPT's softmax_scale is not supported",
                            "logit_scale": "MPT's logit_scale is not supported"},
               require_values={"attn_type": ("multihead_attention", "only MPT's multi-head attention is supported"),
                               "alibi_bias_max": (8, "only alibi_bias_max 8 is supported")},
               parity_reference="MptForCausalLM"),
)
