"""Tiny checkpoints of ster_dist/families/llama.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "llama_linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
    "llama_yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_key_value_heads=2, sliding_window=5),
    ),
    # the query temperature switches on past position 8, well inside the tests' sequences
    "ministral3": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=6,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "rope_theta": 10000.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.3,
            },
        ),
    ),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(num_key_value_heads=2, no_rope_layers=[1, 0, 1]),
    ),
    # query/key/value biased by attention_bias, the output by attention_out_bias
    "seed_oss": (
        "SeedOssConfig",
        "SeedOssForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            attention_out_bias=True,
            mlp_bias=True,
        ),
    ),
    "iquestcoder": (
        "IQuestCoderConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, attention_bias=True, mlp_bias=True),
    ),
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(num_key_value_heads=2, sliding_window=5, use_bias=True),
    ),
}
VARIANT_FAMILY: dict[str, str] = {"llama_linear": "llama", "llama_yarn": "llama"}
