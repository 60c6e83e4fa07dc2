"""Tiny checkpoints of ster_dist/families/inkling.py, saved as Thinking Machines stores Inkling
(_as_inkling): an inkling_mm_model config around the text config, every text tensor below model.llm
under its own names, gate and up interleaved row by row, and a vision tensor the text map must leave
alone.

Sliding layers with their own head shapes and a window below the test prompts' lengths; the full
layer's extent (rel_extent) below them too, so the bias's zero beyond it is read; log scaling from a
low floor; a padded head (unpadded_vocab_size below vocab_size)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_INKLING = dict(
    num_key_value_heads=2,
    head_dim=16,
    swa_num_attention_heads=6,
    swa_num_key_value_heads=2,
    swa_head_dim=8,
    sliding_window_size=8,
    d_rel=4,
    rel_extent=16,
    log_scaling_n_floor=4,
    log_scaling_alpha=0.3,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
    mlp_layer_types=["dense", "dense", "dense"],
    conv_kernel_size=4,
    logits_mup_width_multiplier=2.5,
    unpadded_vocab_size=380,
)

TINY: dict[str, tuple[str, str, dict]] = {
    "inkling_text": ("InklingTextConfig", "InklingForCausalLM", _INKLING),
    # a dense first layer, then six routed experts (top-2) beside two shared ones the router weighs
    # too
    "inkling_text_moe": (
        "InklingTextConfig",
        "InklingForCausalLM",
        dict(
            _INKLING,
            mlp_layer_types=["dense", "sparse", "sparse"],
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=2,
            moe_intermediate_size=24,
            route_scale=2.5,
        ),
    ),
}
VARIANT_FAMILY = {"inkling_text_moe": "inkling_text"}

# Transformers' names (after model.layers.{i}.) -> Thinking Machines' (after model.llm.layers.{i}.)
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn.wq_du.weight",
    "self_attn.k_proj.weight": "attn.wk_dv.weight",
    "self_attn.v_proj.weight": "attn.wv_dv.weight",
    "self_attn.r_proj.weight": "attn.wr_du.weight",
    "self_attn.o_proj.weight": "attn.wo_ud.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "self_attn.k_sconv.conv1d.weight": "attn.k_sconv.weight",
    "self_attn.v_sconv.conv1d.weight": "attn.v_sconv.weight",
    "self_attn.rel_logits_proj.proj": "attn.rel_logits_proj.proj",
    "attn_sconv.conv1d.weight": "attn_sconv.weight",
    "mlp_sconv.conv1d.weight": "mlp_sconv.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.down_proj.weight": "mlp.w2_md.weight",
    "mlp.global_scale": "mlp.global_scale",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.gate.e_score_correction_bias": "mlp.gate.bias",
    "mlp.experts.down_proj": "mlp.experts.w2_weight",
    "mlp.shared_experts.down_proj": "mlp.shared_experts.shared_w2_weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "model.llm.embed.weight",
    "model.embed_tokens.embed_norm.weight": "model.llm.embed_norm.weight",
    "model.norm.weight": "model.llm.norm.weight",
    "lm_head.weight": "model.llm.unembed.weight",
}


def _interleaved(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """gate and up rows alternating along dim: row 2j is gate's j, row 2j + 1 up's j."""
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def _as_inkling(directory: Path) -> None:
    path = directory / "config.json"
    text = json.loads(path.read_text())
    outer = {
        "model_type": "inkling_mm_model",
        "architectures": ["InklingForConditionalGeneration"],
        "text_config": text,
        "torch_dtype": text.get("torch_dtype") or text.get("dtype"),
        "image_token_id": 200054,
        "audio_token_id": 200053,
    }
    path.write_text(json.dumps(outer, indent=2))
    for file in directory.glob("*.safetensors"):
        tensors = load_file(file)
        # a tower's tensor, never mapped
        out = {"model.visual.patch_embed.weight": torch.zeros(4, 3)}
        for name, t in tensors.items():
            layer = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
            if layer is None:
                out[_TOP_NAMES[name]] = t
                continue
            i, rest = layer.groups()
            prefix = f"model.llm.layers.{i}."
            if rest == "mlp.gate_proj.weight":
                out[prefix + "mlp.w13_dn.weight"] = _interleaved(
                    t, tensors[f"model.layers.{i}.mlp.up_proj.weight"], 0
                )
            elif rest == "mlp.experts.gate_up_proj":
                gate, up = t.chunk(2, dim=1)
                out[prefix + "mlp.experts.w13_weight"] = _interleaved(gate, up, 1)
            elif rest == "mlp.shared_experts.gate_proj":
                up = tensors[f"model.layers.{i}.mlp.shared_experts.up_proj"]
                out[prefix + "mlp.shared_experts.shared_w13_weight"] = _interleaved(t, up, 1)
            elif rest not in ("mlp.up_proj.weight", "mlp.shared_experts.up_proj"):
                out[prefix + _LAYER_NAMES[rest]] = t
        save_file({k: v.contiguous() for k, v in out.items()}, file, metadata={"format": "pt"})


SAVED_AS = {variant: _as_inkling for variant in TINY}

# the routed one as Transformers' InklingForCausalLM saves it (its own names;
# tests/config/test_config_shape_sweep.py found
# them unmapped): not rewritten, so defined after SAVED_AS
TINY["inkling_text_as_transformers"] = (
    "InklingTextConfig",
    "InklingForCausalLM",
    TINY["inkling_text_moe"][2],
)
VARIANT_FAMILY["inkling_text_as_transformers"] = "inkling_text"
