"""The 131 model_types of seeds/000"s architecture gate, in the seed"s order.

This tuple is the only place the families are enumerated: the gate, its refusal
message, `ster families` and docs/families.md all read it.
"""

FAMILY_NAMES: tuple[str, ...] = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi",
    "phi3", "granite", "granitemoe", "stablelm", "starcoder2", "cohere", "cohere2",
    "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "exaone4", "internlm3", "seed_oss",
    "arcee", "ernie4_5", "minicpm", "orion", "glm", "glm4", "gpt_neox", "gptj",
    "smollm3", "gpt2", "gpt_bigcode", "opt", "bloom", "falcon", "mpt", "deepseek_v2",
    "deepseek_v3", "minicpm3", "mamba", "falcon_mamba", "glm4_moe", "internlm2",
    "exaone", "jamba", "hunyuan_v1_dense", "mamba2", "bamba", "gpt_oss", "lfm2",
    "ernie4_5_moe", "dbrx", "phimoe", "hunyuan_v1_moe", "telechat", "lfm2_moe",
    "granitemoehybrid", "nemotron_h", "jais2", "bailing_moe", "TeleFLM", "falcon_h1",
    "qwen3_next", "kimi_linear", "minimax_m2", "step3_text", "minimax_text_01",
    "minimax", "zamba2", "gemma", "gemma2", "gemma3_text", "gemma4_text",
    "gemma4_unified_text", "mimo", "mellum", "flex_olmo", "granite_swa",
    "granitemoe_swa", "granitemoeshared", "glm4_moe_lite", "iquestcoder",
    "hyperclovax", "vaultgemma", "apertus", "exaone_moe", "solar", "step1",
    "telechat3", "param2moe", "PanguEmbedded", "olmo_hybrid", "hy_v3", "nanbeige",
    "iquestloopcoder", "nemotron-nas", "deepseek_v32", "glm_moe_dsa", "axk1",
    "bailing_hybrid", "mimo_v2_flash", "mimo_v2", "step3p5", "k2_horizon",
    "pangu_ultra_moe", "longcat_flash", "sarvam_moe", "sarvam_mla", "cohere2_moe",
    "deepseek", "ministral3", "llama4_text", "qwen3_5_text", "qwen3_5_moe_text",
    "afmoe", "nemotron_h_puzzle", "chatglm", "laguna", "longcat_flash_ngram",
    "muse_glimmer_text", "plamo3", "gemma3n_text", "hrm_text", "inkling_text",
    "deepseek_v4", "glm5_next_text", "hy_v4", "minimax_m3_vl_text", "dots3_note",
)
