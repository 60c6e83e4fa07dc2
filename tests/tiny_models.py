"""Tiny random checkpoints of every Transformers-implemented family, built at test time.

Each entry: (Transformers config class name, model class name, config kwargs). Sizes are
small and odd where the family allows: key-value heads below heads, head_dim unlike
hidden/heads, vocab not divisible by two, tied and untied heads, rope scaling variants.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny_classic import TINY_CLASSIC, UNSTATED_BASE_CLASSIC, VARIANT_FAMILY_CLASSIC
from tests.tiny_dense_extra import TINY_DENSE_EXTRA, VARIANT_FAMILY_DENSE_EXTRA
from tests.tiny_llama_variants import TINY_LLAMA_VARIANTS, VARIANT_FAMILY_LLAMA_VARIANTS
from tests.tiny_moe_extra import TINY_MOE_EXTRA, VARIANT_FAMILY_MOE_EXTRA
from tests.tiny_moe_variants import TINY_MOE_VARIANTS, VARIANT_FAMILY_MOE_VARIANTS
from tests.tiny_olmo_glm import TINY_OLMO_GLM, VARIANT_FAMILY_OLMO_GLM
from tests.tiny_tokenizer import TINY_VOCAB_SIZE

VOCAB = TINY_VOCAB_SIZE + 1  # odd, and one row more than the tokenizer uses, as real checkpoints often have
_BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8],
             "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "original_max_position_embeddings": 32}

TINY: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, head_dim=16, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                                             rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                              "rope_theta": 10000.0})),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, use_sliding_window=True,
                                                      sliding_window=4, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                                                         query_pre_attn_scalar=20, attn_logit_softcapping=5.0,
                                                         final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                                                                  sliding_window_pattern=2, query_pre_attn_scalar=16)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=4, qk_layernorm=True, partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2, sliding_window=6, rope_parameters={
        **_LONGROPE, "rope_theta": 10000.0, "partial_rotary_factor": 1.0})),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(num_key_value_heads=2, embedding_multiplier=3.0,
                                                            residual_multiplier=0.5, attention_multiplier=0.2,
                                                            logits_scaling=4.0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(num_key_value_heads=2, qk_layernorm=True,
                                                               use_qkv_bias=True, use_parallel_residual=True,
                                                               partial_rotary_factor=0.5)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(num_key_value_heads=2, sliding_window=5,
                                                                     use_bias=True)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_key_value_heads=2, use_qk_norm=True, logit_scale=0.5)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=48, n_layer=3, n_head=4, n_positions=128, n_inner=80)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5, use_parallel_residual=True)),
    "gpt_neox_seq": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5, use_parallel_residual=False)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_key_value_heads=2, no_rope_layers=[1, 0, 1])),
    # mixture of experts and latent attention: 6-8 experts, top-2, so expert-parallel ranks get uneven loads
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2, num_local_experts=8,
                                                            num_experts_per_tok=2, intermediate_size=24,
                                                            sliding_window=6)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                                                      intermediate_size=24, clip_qkv=1.5)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, intermediate_size=24,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)),
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(
        d_model=48, n_layers=3, n_heads=4, max_seq_len=128, attn_config=dict(kv_n_heads=2, clip_qkv=0.3),
        ffn_config=dict(ffn_hidden_size=24, moe_num_experts=6, moe_top_k=2))),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, kv_lora_rank=16,
        q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        use_qk_norm=True, attention_bias=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, intermediate_size=24,
        sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        swiglu_limit=0.1, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "original_max_position_embeddings": 32, "truncate": False,
                                           "rope_theta": 10000.0})),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, scale_emb=2.0,
        scale_depth=1.4, dim_model_base=32)),
}


TINY.update(TINY_OLMO_GLM)
TINY.update(TINY_LLAMA_VARIANTS)
TINY.update(TINY_MOE_VARIANTS)
TINY.update(TINY_CLASSIC)
TINY.update(TINY_DENSE_EXTRA)
TINY.update(TINY_MOE_EXTRA)
_VARIANT_FAMILY = {"llama_linear": "llama", "llama_yarn": "llama", "gpt_neox_seq": "gpt_neox",
                   **VARIANT_FAMILY_OLMO_GLM, **VARIANT_FAMILY_LLAMA_VARIANTS, **VARIANT_FAMILY_MOE_VARIANTS,
                   **VARIANT_FAMILY_CLASSIC, **VARIANT_FAMILY_DENSE_EXTRA, **VARIANT_FAMILY_MOE_EXTRA}


def family_of_variant(variant: str) -> str:
    return _VARIANT_FAMILY.get(variant, variant)


def make_tiny(variant: str, directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Save a tiny random checkpoint (safetensors + config.json + a tokenizer) and return the Transformers model."""
    import transformers

    config_cls, model_cls, kwargs = TINY[variant]
    base = {k: v for k, v in _BASE.items() if not (variant in ("gpt2", "dbrx") and k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"))}
    base = {k: v for k, v in base.items() if k not in UNSTATED_BASE_CLASSIC.get(variant, ())}
    config = getattr(transformers, config_cls)(**{**base, **kwargs})
    if variant == "dbrx":  # Transformers 5.2x's DBRX attention reads attn_config.rope_theta, which its config lacks
        config.attn_config.rope_theta = 10000.0
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    _perturb_norms(model, seed)
    _perturb_experts(model, variant, seed)
    model.save_pretrained(directory, safe_serialization=True)
    from tests.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(Path(directory))
    return model


def _perturb_norms(model, seed: int) -> None:
    """Random inits leave norm scales at one and biases at zero; perturb them so parity tests see them."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.1)


def _perturb_experts(model, variant: str, seed: int) -> None:
    """Random inits leave DeepSeek-V3's selection bias and GPT-OSS's expert biases at zero; set them. In one
    layer, steer the router away from the upper half of the experts, so that under two expert-parallel ranks
    the second receives no token there."""
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, t in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith("e_score_correction_bias") or (".experts." in name and name.endswith("_bias")):
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.05)
        last = model.config.num_hidden_layers - 1
        for name, t in list(model.named_buffers()) + list(model.named_parameters()):
            if f"layers.{last}." not in name:
                continue
            if variant in ("deepseek_v3", "glm4_moe_lite", "ernie4_5_moe", "minimax_m2", "exaone_moe") \
                    and name.endswith("e_score_correction_bias"):
                t[..., t.shape[-1] // 2:] -= 10.0  # ERNIE's bias is [1, experts]
            if variant == "gpt_oss" and name.endswith("mlp.router.bias"):
                t[t.shape[0] // 2:] -= 100.0


# their last layer routes no token to the upper half of the experts
STARVED = {"deepseek_v3", "gpt_oss", "glm4_moe_lite", "ernie4_5_moe", "minimax_m2", "exaone_moe"}


def read_config(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())
