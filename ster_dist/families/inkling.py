"""Inkling (Thinking Machines; inkling_text, the text decoder inside inkling_mm_model), read as
Thinking Machines stores it below model.llm (and as Transformers' InklingForCausalLM saves it, under
its own names): embed and its RMS norm embed_norm, layers.{i} with attn_norm and mlp_norm, the final
norm, and the head unembed, which reads the final norm's output divided by
logits_mup_width_multiplier (ModelConfig.logit_multiplier) and scores only the first
unpadded_vocab_size tokens (scored_vocab).

Every layer's token mixer is the "inkling_attention" kind (model/inkling.py: the distance bias,
per-head norms, k_sconv and v_sconv); layer_types marks the sliding ones ("hybrid_sliding"; else
local_layer_ids, else all but every sixth). Attention's and the feed-forward's outputs pass residual
short convolutions (attn_sconv, mlp_sconv: ModelConfig.sublayer_conv). The dense feed-forward stores
gate and up interleaved row by row in mlp.w13_dn and multiplies its output by mlp.global_scale. The
routed one (mlp_layer_types "sparse", else every layer from dense_mlp_idx) scores n_routed_experts +
n_shared_experts logits with mlp.gate, chooses the top num_experts_per_tok routed experts by sigmoid
+ mlp.gate.bias, and weighs every chosen and shared expert by its sigmoid over the sum of theirs,
times route_scale and mlp.gate.global_scale (moe/router.py route_with_shared); experts and shared
experts store gate and up interleaved too (w13_weight, shared_w13_weight). Thinking Machines' own
config is read as Transformers reads it: dense_intermediate_size is the dense width,
intermediate_size the experts', sconv_kernel_size the convolutions', model_max_length the context.

Decoder parameters beyond the common ones: layers.{i}.attn.{r,rel,k_sconv,v_sconv},
layers.{i}.{attn_sconv,mlp_sconv}, layers.{i}.mlp.scale, layers.{i}.mlp.router.scale,
layers.{i}.mlp.shared_experts.{gate,up,down} (stacked like the routed experts).
"""

from __future__ import annotations

from ster_dist.families.moe_layouts import EXPERTS, ROUTER_CORRECTION
from ster_dist.families.normalize import ConfigProblem, with_defaults
from ster_dist.families.spec import (
    FamilySpec,
    Fused,
    MoESpec,
    NormSpec,
    PositionSpec,
    Rule,
    Stacked,
)

# InklingTextConfig's defaults of the keys this normalisation reads
_DEFAULTS = {
    "vocab_size": 201024,
    "hidden_size": 6144,
    "num_hidden_layers": 66,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 16,
    "swa_head_dim": 128,
    "sliding_window_size": 512,
    "d_rel": 16,
    "rel_extent": 1024,
    "log_scaling_n_floor": None,
    "log_scaling_alpha": 0.1,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "conv_kernel_size": 4,
    "intermediate_size": 24576,
    "hidden_act": "silu",
    "moe_intermediate_size": 3072,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "route_scale": 8.0,
    "logits_mup_width_multiplier": 24.0,
}
_POSITIVE = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "swa_num_attention_heads",
    "swa_num_key_value_heads",
    "swa_head_dim",
    "sliding_window_size",
    "d_rel",
    "rel_extent",
    "conv_kernel_size",
)


def _positive(out: dict, key: str) -> int:
    value = out[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigProblem(f"{key} is {value!r}; Inkling needs a positive integer there")
    return value


def _layer_types(out: dict, layers: int) -> list[str]:
    types = out.get("layer_types")
    if types is None:
        local = out.get("local_layer_ids")
        local = set(local) if local is not None else {i for i in range(layers) if (i + 1) % 6}
        types = ["hybrid_sliding" if i in local else "hybrid" for i in range(layers)]
    if (
        not isinstance(types, list)
        or len(types) != layers
        or any(t not in ("hybrid", "hybrid_sliding") for t in types)
    ):
        raise ConfigProblem(
            f'layer_types is {types!r}; state "hybrid" or "hybrid_sliding" for each of the '
            f"{layers} layers"
        )
    return types


def _mlp_types(out: dict, layers: int) -> list[str]:
    types = out.get("mlp_layer_types")
    if types is None:
        first = out.get("dense_mlp_idx") or 0
        types = ["dense" if i < first else "sparse" for i in range(layers)]
    if (
        not isinstance(types, list)
        or len(types) != layers
        or any(t not in ("dense", "sparse") for t in types)
    ):
        raise ConfigProblem(
            f'mlp_layer_types is {types!r}; state "dense" or "sparse" for each of the '
            f"{layers} layers"
        )
    return types


def _normalize(raw: dict) -> dict:
    out = with_defaults(raw, _DEFAULTS)
    # Thinking Machines' own names, as Transformers' InklingTextConfig reads them
    if out.get("sconv_kernel_size") is not None:
        out["conv_kernel_size"] = out["sconv_kernel_size"]
    if out.get("model_max_length") is not None:
        out["max_position_embeddings"] = out["model_max_length"]
    # intermediate_size is then the experts' width
    if out.get("dense_intermediate_size") is not None:
        out["moe_intermediate_size"] = out["intermediate_size"]
        out["intermediate_size"] = out["dense_intermediate_size"]
    out["dense_intermediate_size"] = None
    for key in _POSITIVE:
        _positive(out, key)
    layers = out["num_hidden_layers"]
    # the mixer reads its own layer's kind; the shared reader sees no sliding layer (the kind keeps
    # its window)
    out["inkling_layer_types"] = _layer_types(out, layers)
    out["inkling_mlp_layer_types"] = _mlp_types(out, layers)
    out["layer_types"] = out["sliding_window"] = None
    floor = out.get("log_scaling_n_floor")
    if floor is not None and (
        isinstance(floor, bool) or not isinstance(floor, (int, float)) or floor <= 0
    ):
        raise ConfigProblem(
            f"log_scaling_n_floor is {floor!r}; state a positive number (or null for no scaling)"
        )
    width = out["logits_mup_width_multiplier"]
    if isinstance(width, bool) or not isinstance(width, (int, float)) or width == 0:
        raise ConfigProblem(
            f"logits_mup_width_multiplier is {width!r}; it must be a non-zero number"
        )
    out["logit_scale"] = 1.0 / width
    out["scored_vocab_size"] = out.get("unpadded_vocab_size")
    out["sublayer_conv_kernel"] = out["conv_kernel_size"]
    out["mlp_output_scale"] = True
    out["routed_scaling_factor"] = out["route_scale"]
    out["tie_word_embeddings"] = False  # embed and unembed are separate tensors in every checkpoint
    return out


def _layers(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (
        ("inkling_attention",) * layers,
        tuple("moe" if kind == "sparse" else "dense" for kind in raw["inkling_mlp_layer_types"]),
    )


_LLM = "model.llm."
_SHARED = "layers.{i}.mlp.shared_experts."
_LAYER = f"{_LLM}layers.{{i}}."
_ATTN = {
    "wq_du": "q",
    "wk_dv": "k",
    "wv_dv": "v",
    "wr_du": "r",
    "wo_ud": "o",
    "q_norm": "q_norm",
    "k_norm": "k_norm",
    "k_sconv": "k_sconv",
    "v_sconv": "v_sconv",
}
_RULES = (
    Rule(f"{_LLM}embed.weight", "embed.weight"),
    Rule(f"{_LLM}embed_norm.weight", "embed_norm.weight"),
    Rule(f"{_LLM}norm.weight", "final_norm.weight"),
    Rule(f"{_LLM}unembed.weight", "lm_head.weight"),
    *(
        Rule(f"{_LAYER}{name}.weight", f"layers.{{i}}.{name}.weight")
        for name in ("attn_norm", "mlp_norm", "attn_sconv", "mlp_sconv")
    ),
    *(
        Rule(f"{_LAYER}attn.{name}.weight", f"layers.{{i}}.attn.{target}.weight")
        for name, target in _ATTN.items()
    ),
    Rule(f"{_LAYER}attn.rel_logits_proj.proj", "layers.{i}.attn.rel.weight"),
    # gate and up alternate row by row: `intermediate` groups of one gate row and one up row
    Rule(
        f"{_LAYER}mlp.w13_dn.weight",
        Fused(
            (("layers.{i}.mlp.gate.weight", "one"), ("layers.{i}.mlp.up.weight", "one")),
            groups="intermediate",
            unit="one",
        ),
    ),
    Rule(f"{_LAYER}mlp.w2_md.weight", "layers.{i}.mlp.down.weight"),
    Rule(f"{_LAYER}mlp.global_scale", "layers.{i}.mlp.scale.weight"),
    # the routed feed-forward: the router scores the routed experts, then the shared ones
    Rule(f"{_LAYER}mlp.gate.weight", "layers.{i}.mlp.router.weight"),
    Rule(f"{_LAYER}mlp.gate.bias", ROUTER_CORRECTION),
    Rule(f"{_LAYER}mlp.gate.global_scale", "layers.{i}.mlp.router.scale"),
    Rule(
        f"{_LAYER}mlp.experts.w13_weight",
        Stacked((f"{EXPERTS}gate", f"{EXPERTS}up"), interleaved=True),
    ),
    Rule(f"{_LAYER}mlp.experts.w2_weight", Stacked((f"{EXPERTS}down",))),
    Rule(
        f"{_LAYER}mlp.shared_experts.shared_w13_weight",
        Stacked((f"{_SHARED}gate", f"{_SHARED}up"), interleaved=True),
    ),
    Rule(f"{_LAYER}mlp.shared_experts.shared_w2_weight", Stacked((f"{_SHARED}down",))),
)

# what Transformers' InklingForCausalLM saves: its own names below model., gate and up apart (the
# routed experts'
# halves joined, gate first), each shared expert's projections stacked
_HF = "model.layers.{i}."
_HF_ATTN = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "r_proj": "r",
    "o_proj": "o",
    "q_norm": "q_norm",
    "k_norm": "k_norm",
    "k_sconv.conv1d": "k_sconv",
    "v_sconv.conv1d": "v_sconv",
}
_TRANSFORMERS_RULES = (
    Rule("model.embed_tokens.weight", "embed.weight"),
    Rule("model.embed_tokens.embed_norm.weight", "embed_norm.weight"),
    Rule("model.norm.weight", "final_norm.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
    Rule(f"{_HF}input_layernorm.weight", "layers.{i}.attn_norm.weight"),
    Rule(f"{_HF}post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight"),
    *(
        Rule(f"{_HF}{name}.conv1d.weight", f"layers.{{i}}.{name}.weight")
        for name in ("attn_sconv", "mlp_sconv")
    ),
    *(
        Rule(f"{_HF}self_attn.{name}.weight", f"layers.{{i}}.attn.{target}.weight")
        for name, target in _HF_ATTN.items()
    ),
    Rule(f"{_HF}self_attn.rel_logits_proj.proj", "layers.{i}.attn.rel.weight"),
    *(
        Rule(f"{_HF}mlp.{name}_proj.weight", f"layers.{{i}}.mlp.{name}.weight")
        for name in ("gate", "up", "down")
    ),
    Rule(f"{_HF}mlp.global_scale", "layers.{i}.mlp.scale.weight"),
    Rule(f"{_HF}mlp.gate.weight", "layers.{i}.mlp.router.weight"),
    Rule(f"{_HF}mlp.gate.e_score_correction_bias", ROUTER_CORRECTION),
    Rule(f"{_HF}mlp.gate.global_scale", "layers.{i}.mlp.router.scale"),
    Rule(f"{_HF}mlp.experts.gate_up_proj", Stacked((f"{EXPERTS}gate", f"{EXPERTS}up"))),
    Rule(f"{_HF}mlp.experts.down_proj", Stacked((f"{EXPERTS}down",))),
    *(
        Rule(f"{_HF}mlp.shared_experts.{name}_proj", Stacked((f"{_SHARED}{name}",)))
        for name in ("gate", "up", "down")
    ),
)

INKLING_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "inkling_text",
        _RULES + _TRANSFORMERS_RULES,
        norms=NormSpec(embed=True),
        positions=PositionSpec(kind="none"),
        moe=MoESpec(
            scoring="sigmoid",
            correction_bias=True,
            shared="routed",
            scaling="always",
            router_scale=True,
        ),
        normalize=_normalize,
        layer_kinds=_layers,
        parity_reference="InklingForCausalLM",
    ),
)
