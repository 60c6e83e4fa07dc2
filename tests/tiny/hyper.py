"""Tiny checkpoints of ster_dist/families/hyper.py's families."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY: dict[str, tuple[str, str, dict]] = {
    # three streams; fewer indexer keys (index_topk) than the parity prompts' 40 tokens; the middle layer reuses
    # the first's choice; a small swiglu_limit so the experts' clamp bites; a dense first layer
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, routed_scaling_factor=1.5,
        index_topk=12, index_n_heads=8, index_head_dim=16, indexer_types=["full", "shared", "full"], hc_mult=3,
        hc_magnitude=1.5, swiglu_limit=0.1, initializer_range=0.02)),
}


def _pairs_order(rows: int) -> torch.Tensor:
    """The release's order of a rotated slice stored by halves: channel i and i + rows/2 side by side."""
    half = rows // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()


def _as_hy_v4_release(directory: Path) -> None:
    """Rewrite the checkpoint as HY V4 publishes it (Megatron's layout, which vLLM rotates by adjacent pairs):
    the rotated rows of q_b_proj (each head's last qk_rope_head_dim) and kv_a_proj_with_mqa (its last ones) in
    pair order, so that pairs rotating on them equal Transformers' halves rotating on its own rows."""
    config = json.loads((directory / "config.json").read_text())
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    order = _pairs_order(rope)
    for file in directory.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith("self_attn.q_b_proj.weight"):
                heads = t.view(-1, nope + rope, t.shape[-1])
                tensors[name] = torch.cat((heads[:, :nope], heads[:, nope:][:, order]), dim=1).reshape(t.shape)
            elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
                tensors[name] = torch.cat((t[:-rope], t[-rope:][order]))
        save_file(tensors, file, metadata={"format": "pt"})


SAVED_AS = {"hy_v4": _as_hy_v4_release}
