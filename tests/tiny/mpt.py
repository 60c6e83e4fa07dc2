"""Tiny checkpoints of ster_dist/families/mpt.py's families."""

from __future__ import annotations

TINY: dict[str, tuple[str, str, dict]] = {
    "mpt": ("MptConfig", "MptForCausalLM", dict(max_seq_len=128)),
    "dbrx": (
        "DbrxConfig",
        "DbrxForCausalLM",
        dict(
            d_model=48,
            n_layers=3,
            n_heads=4,
            max_seq_len=128,
            attn_config=dict(kv_n_heads=2, clip_qkv=0.3),
            ffn_config=dict(ffn_hidden_size=24, moe_num_experts=6, moe_top_k=2),
        ),
    ),
}
# a top-level num_key_value_heads unlike attn_config.kv_n_heads, which Transformers' attention reads
# (tests/config/test_config_shape_sweep.py found the top-level one read)
TINY["dbrx_kv_copy"] = (
    "DbrxConfig",
    "DbrxForCausalLM",
    dict(TINY["dbrx"][2], num_key_value_heads=4),
)
VARIANT_FAMILY = {"dbrx_kv_copy": "dbrx"}
# both state their sizes under MosaicML's own names
UNSTATED_BASE: dict[str, tuple[str, ...]] = {
    "mpt": ("intermediate_size", "max_position_embeddings"),
    "dbrx": (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
    ),
}
UNSTATED_BASE["dbrx_kv_copy"] = UNSTATED_BASE["dbrx"]
