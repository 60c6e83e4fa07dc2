"""Tiny checkpoints of ster_dist/families/gemma4.py's families."""

from __future__ import annotations

from tests.tiny_tokenizer import TINY_VOCAB_SIZE

_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# four layers, sliding (window 4, 16-wide heads over two key-value heads) and full (24-wide heads, a
# proportional
# rotation turning half their pairs); the last two layers reuse the first two's keys and values
_COMMON = dict(
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=24,
    sliding_window=4,
    layer_types=_LAYERS,
    num_kv_shared_layers=2,
    final_logit_softcapping=5.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.5,
            "rope_theta": 100000.0,
        },
    },
)
# gemma4_text: the E models' per-layer inputs (8 wide) and, under attention_k_eq_v, full layers of
# one
# key-value head without v_proj; gemma4_text_moe: top-2 of six experts beside the dense
# feed-forward, no
# per-layer inputs; gemma4_unified_text: no sharing, full layers with their own values
TINY: dict[str, tuple[str, str, dict]] = {
    "gemma4_text": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            _COMMON,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=TINY_VOCAB_SIZE + 1,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            enable_moe_block=False,
        ),
    ),
    "gemma4_text_moe": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            _COMMON,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=6,
            top_k_experts=2,
            moe_intermediate_size=24,
            num_kv_shared_layers=0,
        ),
    ),
    "gemma4_unified_text": (
        "Gemma4UnifiedTextConfig",
        "Gemma4UnifiedForCausalLM",
        dict(_COMMON, num_kv_shared_layers=0),
    ),
}
VARIANT_FAMILY = {"gemma4_text_moe": "gemma4_text"}
