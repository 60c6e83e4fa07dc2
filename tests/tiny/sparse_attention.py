"""Tiny checkpoints of ster_dist/families/sparse_attention.py's families."""

from __future__ import annotations

import json
from pathlib import Path

TINY: dict[str, tuple[str, str, dict]] = {
    # indexed, sliding, indexed layers: the sliding one with fewer heads and narrower latents of its
    # own, a
    # window below the parity prompts' 40 tokens and its own base; fewer indexer keys than the
    # prompts' tokens
    "dots3_note": (
        "Dots3NoteTextConfig",
        "Dots3NoteForCausalLM",
        dict(
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            shared_experts_intermediate_size=20,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            head_dim=12,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            index_topk=12,
            index_n_heads=8,
            index_head_dim=16,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            swa_num_attention_heads=2,
            swa_num_key_value_heads=2,
            swa_q_lora_rank=20,
            swa_kv_lora_rank=12,
            swa_head_dim=14,
            swa_qk_nope_head_dim=10,
            swa_v_head_dim=8,
            sliding_window_size=8,
            rope_theta=20000.0,
            swa_rope_theta=5000.0,
        ),
    ),
}


def _as_dots3_note_release(directory: Path) -> None:
    """Rewrite the saved config as Dots3-Note publishes it: the text config at the top level under
    model_type dots3_note, the sliding layers' sizes as swa_* keys (not Transformers'
    per_layer_config), full_attention for the indexed layers, and the two bases as rope_theta and
    swa_rope_theta."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    per_layer = config.pop("per_layer_config")
    sliding = next(iter(per_layer.values()))
    rope = config.pop("rope_parameters")
    config.update({f"swa_{key}": value for key, value in sliding.items()})
    config.update(
        model_type="dots3_note",
        architectures=["Dots3NoteForConditionalGeneration"],
        layer_types=[
            {"indexed_attention": "full_attention"}.get(k, k) for k in config["layer_types"]
        ],
        rope_theta=rope["indexed_attention"]["rope_theta"],
        swa_rope_theta=rope["sliding_attention"]["rope_theta"],
        sliding_window_size=config.pop("sliding_window"),
        attention_gate_type="headwise",
        swa_attention_gate_type="headwise",
        apply_mla_qkv_lora_rescale=True,
    )
    path.write_text(json.dumps(config, indent=2))


SAVED_AS = {"dots3_note": _as_dots3_note_release}
