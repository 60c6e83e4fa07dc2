"""Tiny checkpoints of ster_dist/families/mimo.py's MiMo-V2 families."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# sliding layers (window 5, twice the full layers' two key-value heads, sinks) around two full ones,
# each kind at
# its own base over a third of each 24-wide head, 16-wide values scaled by 0.6; top-2 of six experts
# by
# DeepSeek-V3's router after a dense first layer
_FLASH = dict(
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=24,
    v_head_dim=16,
    sliding_window=5,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    attention_value_scale=0.6,
    n_routed_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    routed_scaling_factor=1.5,
    rope_parameters={
        "full_attention": {
            "rope_type": "default",
            "rope_theta": 50000.0,
            "partial_rotary_factor": 0.334,
        },
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.334,
        },
    },
)
TINY: dict[str, tuple[str, str, dict]] = {
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", _FLASH),
    # MiMo-V2.5 is the same model: Transformers' MiMo-V2-Flash, saved as Xiaomi's fused release
    # (_as_mimo_v2)
    "mimo_v2": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", _FLASH),
}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Xiaomi's qkv_proj: `groups` (num_key_value_heads) blocks, each its share of q rows, then k,
    then v."""
    return torch.cat(
        [torch.cat(parts) for parts in zip(q.chunk(groups), k.chunk(groups), v.chunk(groups))]
    )


def _as_mimo_v2(directory: Path) -> None:
    """Rewrite the saved checkpoint as a MiMo-V2.5 release: model_type mimo_v2, Xiaomi's config keys
    (hybrid_layer_pattern, moe_layer_freq, rope_theta / swa_rope_theta, layernorm_epsilon) and
    attention_projection_layout fused_qkv over one qkv_proj per layer, sinks under
    attention_sink_bias."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    kinds, rotations = config.pop("layer_types"), config.pop("rope_parameters")
    sparse = config.pop("mlp_layer_types")
    kv = config["num_key_value_heads"]
    config.update(
        model_type="mimo_v2",
        architectures=["MiMoV2ForCausalLM"],
        attention_projection_layout="fused_qkv",
        hybrid_layer_pattern=[int(kind == "sliding_attention") for kind in kinds],
        moe_layer_freq=[int(kind == "sparse") for kind in sparse],
        swa_num_key_value_heads=2 * kv,
        swa_num_attention_heads=config["num_attention_heads"],
        swa_head_dim=config["head_dim"],
        swa_v_head_dim=config["v_head_dim"],
        rope_theta=rotations["full_attention"]["rope_theta"],
        swa_rope_theta=rotations["sliding_attention"]["rope_theta"],
        partial_rotary_factor=rotations["full_attention"]["partial_rotary_factor"],
        layernorm_epsilon=config.pop("rms_norm_eps"),
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
    )
    path.write_text(json.dumps(config, indent=2))
    for file in directory.glob("*.safetensors"):
        tensors = load_file(file)
        for i in range(config["num_hidden_layers"]):
            attn = f"model.layers.{i}.self_attn"
            q, k, v = (tensors.pop(f"{attn}.{p}_proj.weight") for p in "qkv")
            tensors[f"{attn}.qkv_proj.weight"] = fuse_qkv(q, k, v, kv)
            if f"{attn}.sinks" in tensors:
                tensors[f"{attn}.attention_sink_bias"] = tensors.pop(f"{attn}.sinks")
        save_file(tensors, file, metadata={"format": "pt"})


SAVED_AS = {"mimo_v2": _as_mimo_v2}
