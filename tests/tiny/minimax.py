"""Tiny checkpoints of ster_dist/families/minimax.py's families."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

# lightning layers around one attention layer, blocks of eight tokens (so a read spans several),
# each
# sublayer's residual factors unlike one another, head_dim unlike hidden / heads, six top-2 experts
_MINIMAX = dict(
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    block_size=8,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    num_local_experts=6,
    num_experts_per_tok=2,
    intermediate_size=24,
    linear_attn_alpha_factor=1.3,
    linear_attn_beta_factor=0.7,
    full_attn_alpha_factor=0.9,
    full_attn_beta_factor=1.2,
    mlp_alpha_factor=1.1,
    mlp_beta_factor=0.8,
)

TINY: dict[str, tuple[str, str, dict]] = {
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", _MINIMAX),
    # the same model saved as MiniMax's own release (_as_minimax_text_01)
    "minimax_text_01": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(
            _MINIMAX,
            layer_types=[
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
        ),
    ),
}

_FACTORS = {
    "linear_attn_alpha_factor": "layernorm_linear_attention_alpha",
    "linear_attn_beta_factor": "layernorm_linear_attention_beta",
    "full_attn_alpha_factor": "layernorm_full_attention_alpha",
    "full_attn_beta_factor": "layernorm_full_attention_beta",
    "mlp_alpha_factor": "layernorm_mlp_alpha",
    "mlp_beta_factor": "layernorm_mlp_beta",
}
_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def _as_minimax_text_01(directory: Path) -> None:
    """Rewrite a saved Transformers MiniMax checkpoint as MiniMax-Text-01's own: its config keys
    (attn_type_list, layernorm_* factors, postnorm, rotary_dim over the whole head) and its tensors
    without the decay buffers Transformers saves (it already saves the experts as
    block_sparse_moe.experts.{e}.w1/w3/w2)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["model_type"], config["architectures"] = "minimax_text_01", ["MiniMaxText01ForCausalLM"]
    config["attn_type_list"] = [
        0 if t == "linear_attention" else 1 for t in config.pop("layer_types")
    ]
    for name, own in _FACTORS.items():
        config[own] = config.pop(name)
    config.update(postnorm=True, rotary_dim=config["head_dim"], shared_intermediate_size=0)
    path.write_text(json.dumps(config, indent=2))
    for file in directory.glob("*.safetensors"):
        tensors = load_file(file)
        save_file(
            {name: t for name, t in tensors.items() if not name.endswith(_BUFFERS)},
            file,
            metadata={"format": "pt"},
        )


SAVED_AS = {"minimax_text_01": _as_minimax_text_01}
VARIANT_FAMILY: dict[str, str] = {}
