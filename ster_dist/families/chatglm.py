"""ChatGLM (GLM-4-9B, ChatGLM2, ChatGLM3), published as remote code (model_type chatglm), as data.

As seeds/000 describes it: everything below `transformer`: embedding.word_embeddings,
encoder.layers.{i} with self_attention.query_key_value (queries, keys, values stacked; biased under
add_qkv_bias or add_bias_linear) and self_attention.dense, mlp.dense_h_to_4h (gate rows above up
rows) and dense_4h_to_h, encoder.final_layernorm, and output_layer as the head. Heads are
kv_channels wide, with multi_query_group_num key-value groups under multi_query_attention; the first
half of each head rotates at base 10000 * rope_ratio, as adjacent pairs under original_rope (else as
halves). RMS norms under rmsnorm, LayerNorms otherwise. A residual after the norm or a missing final
norm is refused. The block is Transformers' GLM (families/glm.py) under these names:
tests/families/test_chatglm.py checks it against GlmForCausalLM on the same weights. Its tokenizer
is GLM-4's tiktoken tokenizer.model (tokenizer_files.py).
"""

from __future__ import annotations

from ster_dist.families.layouts import fused_gate_up, fused_qkv, weight_and_bias
from ster_dist.families.normalize import ConfigProblem, biases, switch
from ster_dist.families.spec import FamilySpec, Fused, PositionSpec, Rule

_T, _LAYER = "transformer.", "transformer.encoder.layers.{i}."
_RULES = (
    Rule(f"{_T}embedding.word_embeddings.weight", "embed.weight"),
    *weight_and_bias(f"{_T}output_layer", "lm_head"),
    *weight_and_bias(f"{_T}encoder.final_layernorm", "final_norm"),
    *weight_and_bias(f"{_LAYER}input_layernorm", "layers.{i}.attn_norm"),
    *weight_and_bias(f"{_LAYER}post_attention_layernorm", "layers.{i}.mlp_norm"),
    *fused_qkv(f"{_LAYER}self_attention.query_key_value"),
    *weight_and_bias(f"{_LAYER}self_attention.dense", "layers.{i}.attn.o"),
    *fused_gate_up(f"{_LAYER}mlp.dense_h_to_4h"),
    *weight_and_bias(f"{_LAYER}mlp.dense_4h_to_h", "layers.{i}.mlp.down"),
    Rule(
        f"{_LAYER}mlp.dense_h_to_4h.bias",
        Fused(
            (
                ("layers.{i}.mlp.gate.bias", "intermediate"),
                ("layers.{i}.mlp.up.bias", "intermediate"),
            ),
            unit="one",
        ),
    ),
)
# ChatGLMConfig's defaults (configuration_chatglm.py)
_DEFAULTS = {
    "num_layers": 28,
    "padded_vocab_size": 65024,
    "hidden_size": 4096,
    "ffn_hidden_size": 13696,
    "kv_channels": 128,
    "num_attention_heads": 32,
    "seq_length": 2048,
    "layernorm_epsilon": 1e-5,
    "rmsnorm": True,
    "apply_residual_connection_post_layernorm": False,
    "post_layer_norm": True,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "multi_query_attention": False,
    "multi_query_group_num": 1,
    "rope_ratio": 1,
    "original_rope": True,
    "tie_word_embeddings": False,
}


def _chatglm(raw: dict) -> dict:
    """ChatGLMConfig's names as the generic keys."""
    out = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    if switch(out, "apply_residual_connection_post_layernorm"):
        raise ConfigProblem(
            "apply_residual_connection_post_layernorm is set; ChatGLM's residual after the norm is "
            "not supported: use a config with it false"
        )
    if not switch(out, "post_layer_norm"):
        raise ConfigProblem(
            "post_layer_norm is false; a ChatGLM without its final norm is not supported: use a "
            "config with post_layer_norm true"
        )
    ratio = out["rope_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
        raise ConfigProblem(
            f"rope_ratio is {ratio!r}; state a positive number (the rotation base is 10000 times it)"
        )
    heads = out["num_attention_heads"]
    kv = out["multi_query_group_num"] if switch(out, "multi_query_attention") else heads
    linear = switch(out, "add_bias_linear")
    return {
        **biases(out, linear or switch(out, "add_qkv_bias"), out=linear, mlp=linear),
        "num_hidden_layers": out["num_layers"],
        "vocab_size": out["padded_vocab_size"],
        "intermediate_size": out["ffn_hidden_size"],
        "head_dim": out["kv_channels"],
        "num_key_value_heads": kv,
        "max_position_embeddings": out["seq_length"],
        "rms_norm_eps": out["layernorm_epsilon"],
        "layer_norm_epsilon": out["layernorm_epsilon"],
        "norm_kind": "rms" if switch(out, "rmsnorm") else "layer",
        "rope_theta": 10000.0 * ratio,
        "rotate_adjacent_pairs": switch(out, "original_rope"),
        "hidden_act": "silu",
        "rope_scaling": None,
        "rope_parameters": None,
    }


CHATGLM_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "chatglm",
        _RULES,
        positions=PositionSpec(interleaved=True, rotary_share=0.5),
        normalize=_chatglm,
        parity_reference="tests/families/test_chatglm.py",
    ),
)
