"""Tiny checkpoints of ster_dist/families/longcat.py's families."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

# two stored layers (four decoder layers), a compressed query, six routed experts and two identity
# experts of
# which each token takes three, scaled; head_dim is the rotated width, which Transformers' rotation
# reads
TINY: dict[str, tuple[str, str, dict]] = {
    "longcat_flash": (
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        dict(
            num_layers=2,
            ffn_hidden_size=80,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            head_dim=4,
            v_head_dim=12,
            n_routed_experts=6,
            zero_expert_num=2,
            moe_topk=3,
            expert_ffn_hidden_size=16,
            routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}
# LongcatFlashConfig states the layer count as num_layers (num_hidden_layers is derived) and the
# feed-forward
# width as ffn_hidden_size
UNSTATED_BASE: dict[str, tuple[str, ...]] = {
    "longcat_flash": ("num_hidden_layers", "intermediate_size")
}


def _as_longcat_release(directory: Path) -> None:
    """Drop the gate and up projections Transformers saves for the identity experts (its stacked
    gate_up_proj has a row block for every scored expert); LongCat's releases store the routed
    experts only, as mla_scale_q_lora / mla_scale_kv_lora state the scales Transformers always
    applies."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(mla_scale_q_lora=True, mla_scale_kv_lora=True, zero_expert_type="identity")
    path.write_text(json.dumps(config, indent=2))
    routed = config["n_routed_experts"]
    for file in directory.glob("*.safetensors"):
        tensors = {
            name: t
            for name, t in load_file(file).items()
            if ".mlp.experts." not in name
            or int(name.split(".mlp.experts.")[1].split(".")[0]) < routed
        }
        save_file(tensors, file, metadata={"format": "pt"})


SAVED_AS = {"longcat_flash": _as_longcat_release}
