"""Falcon-H1: Llama's block whose token mixer is attention and Mamba-2 side by side (the
"attention_mamba2" kind, model/side_by_side.py) on every layer: both read input_layernorm's output
and their sum joins the residual stream; pre_ff_layernorm and the feed_forward follow,
final_layernorm closes the stack. Names as Bamba's: self_attn, mamba, feed_forward.

Its muP multipliers are all applied in forward, the checkpoint's tensors kept as stored:
embedding_multiplier (ModelConfig.embed_scale), lm_head_multiplier (logit_multiplier),
attention_in/out_multiplier and ssm_in/out_multiplier (the side-by-side kind's parts),
ssm_multipliers (the Mamba-2 mixer's five in_proj parts), mlp_multipliers (the dense feed-forward's
gate and output), and key_multiplier, which scales every key and so every attention score: it
multiplies the attention scale (1 / sqrt(head_dim)), which is the same product without a pass over
the keys.

The mixer's options map onto the Mamba-2 kind's settings: mamba_d_ssm (else mamba_expand x
hidden_size) is the scan's width, mamba_d_head "auto" that width over mamba_n_heads; projectors_bias
is out_proj's bias and mamba_proj_bias in_proj's; mamba_rms_norm false leaves the gated norm out;
mamba_norm_before_gate norms before the gate; the conv's activation is hidden_act. Transformers'
single-token step does not clamp dt to time_step_limit while its prompt pass does; ster_dist clamps
both (the published configs state no bound). attn_layer_indices and mamba_use_mlp false (options of
Falcon-H1's original code that Transformers ignores) are refused.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.mamba2 import mamba2_mixer_rules
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.spec import FamilySpec

# FalconH1Config's defaults of the keys its normalisation reads
_DEFAULTS = {
    "mamba_d_ssm": 1024,
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "mamba_norm_before_gate": True,
    "mamba_rms_norm": False,
    "projectors_bias": False,
    "rms_norm_eps": 1e-5,
    "num_key_value_heads": 8,
    "num_attention_heads": 32,
    "max_position_embeddings": 8192,
    "key_multiplier": 1.0,
}


def _int(raw: dict, key: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigProblem(f"{key} is {value!r}; Falcon-H1 needs a positive integer there")
    return value


def _normalize(raw: dict) -> dict:
    out = with_defaults(raw, _DEFAULTS)
    if out.get("attn_layer_indices"):
        raise ConfigProblem(
            f"attn_layer_indices {out['attn_layer_indices']!r} is not supported: every Falcon-H1 "
            "layer runs attention; remove the key"
        )
    if out.get("mamba_use_mlp") is False:
        raise ConfigProblem(
            "mamba_use_mlp false is not supported: every Falcon-H1 layer has its feed-forward; "
            "remove the key"
        )
    hidden = _int(out, "hidden_size")
    width = (
        _int(out, "mamba_d_ssm")
        if out["mamba_d_ssm"] is not None
        else _int(out, "mamba_expand") * hidden
    )
    heads = _int(out, "mamba_n_heads")
    if out["mamba_d_head"] == "auto":
        out["mamba_d_head"] = width // heads
    if _int(out, "mamba_d_head") * heads != width:
        raise ConfigProblem(
            f"mamba_n_heads x mamba_d_head ({heads} x {out['mamba_d_head']}) differs from the scan's "
            f"width mamba_d_ssm (or mamba_expand x hidden_size) {width}; correct one of them"
        )
    # the width is stated above; the mixer's own check reads heads x head_dim
    out["mamba_expand"] = None
    out["mamba_hidden_act"] = out.get("hidden_act") or "silu"
    out["mamba_out_proj_bias"] = bool(out["projectors_bias"])
    if out.get("num_key_value_heads") is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    # every layer is hybrid: the layer kinds say so, and the rotation reads no layer_types
    out["layer_types"] = out["layers_block_type"] = None
    key_multiplier = out["key_multiplier"]
    if isinstance(key_multiplier, bool) or not isinstance(key_multiplier, (int, float)):
        raise ConfigProblem(f"key_multiplier is {key_multiplier!r}; it must be a number")
    head_dim = stated(out, "head_dim", default=hidden // _int(out, "num_attention_heads"))
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ConfigProblem(f"head_dim is {head_dim!r}; Falcon-H1 needs a positive integer there")
    out["attention_multiplier"] = float(key_multiplier) * head_dim**-0.5
    out["logit_scale"] = stated(out, "lm_head_multiplier", default=1.0)
    return out


def _layers(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ("attention_mamba2",) * layers, ("dense",) * layers


FALCON_H1_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "falcon_h1",
        llama_rules(
            mlp="feed_forward",
            mlp_norm="pre_ff_layernorm",
            final_norm="final_layernorm",
            q_norm=None,
            k_norm=None,
        )
        + mamba2_mixer_rules("model.layers.{i}.mamba"),
        normalize=_normalize,
        layer_kinds=_layers,
        parity_reference="FalconH1ForCausalLM",
    ),
)
