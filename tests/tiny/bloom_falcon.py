"""Tiny checkpoints of ster_dist/families/bloom_falcon.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    # six heads: ALiBi slopes of a head count that is not a power of two
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(num_attention_heads=6)),
    # the new decoder architecture: grouped key-value heads, ln_attn and ln_mlp
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=80, bias=False),
    ),
    # Falcon-7B: multi-query, one norm before a parallel block
    "falcon_mq": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(multi_query=True, parallel_attn=True, ffn_hidden_size=80, bias=False),
    ),
    # Falcon-RW: ALiBi, sequential blocks, every head its own key and value, biased
    "falcon_alibi": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(alibi=True, multi_query=False, parallel_attn=False, ffn_hidden_size=80, bias=True),
    ),
}
# a config.json whose num_key_value_heads (Transformers' derived copy) differs from num_kv_heads,
# which Transformers'
# attention reads (tests/config/test_config_shape_sweep.py found the copy read)
TINY["falcon_kv_copy"] = (
    "FalconConfig",
    "FalconForCausalLM",
    dict(TINY["falcon"][2], num_key_value_heads=4),
)
VARIANT_FAMILY: dict[str, str] = {
    "falcon_mq": "falcon",
    "falcon_alibi": "falcon",
    "falcon_kv_copy": "falcon",
}
# their configs state the feed-forward width under their own names (or derive it)
UNSTATED_BASE: dict[str, tuple[str, ...]] = {v: ("intermediate_size",) for v in TINY}
