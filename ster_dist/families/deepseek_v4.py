"""DeepSeek-V4 (deepseek_v4), in Transformers' tensor layout or DeepSeek's own (embed,
layers.{i}.attn.wq_a, ffn.experts, hc_attn_fn, with or without a model. root).

hc_mult residual streams joined by hyper-connections of the comb form (model/hyper_connection.py)
and collapsed by hc_head before the final norm. Every layer's attention is
model/compressed_attention.py's kind, its type per layer from layer_types (or older configs'
compress_ratios: 0, 4, 128): sliding_attention, compressed_sparse_attention (the compressor at the
sparse rate behind the Lightning Indexer) or heavily_compressed_attention (the heavy rate); sliding
layers rotate at rope_theta, compressed ones at compress_rope_theta with the rope_parameters' YaRN
at magnitude one. Every layer routes: sqrtsoftplus scores, the choice with e_score_correction_bias
added, or on the hash_moe layers (mlp_layer_types, else the first num_hash_layers) the token's row
of tid2eid; renormalised, times routed_scaling_factor, beside one shared expert; every SwiGLU is
silu(min(gate, swiglu_limit)) * clamp(up, +-swiglu_limit).
"""

from __future__ import annotations

from ster_dist.families.moe_layouts import ROUTER_CORRECTION, expert_rules
from ster_dist.families.normalize import ConfigProblem
from ster_dist.families.spec import FamilySpec, MoESpec, PositionSpec, Rule

SLIDING, SPARSE, HEAVY = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
_RATIO_KIND = {0: SLIDING, 4: SPARSE, 128: HEAVY}

# DeepseekV4Config's defaults for keys a config leaves out
_DEFAULTS = {
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "rms_norm_eps": 1e-6,
    "num_hash_layers": 3,
}


def _spellings(target: str, *names: str, optional: bool = False) -> list[Rule]:
    """One parameter under DeepSeek's own name and Transformers' (a checkpoint holds one of
    them)."""
    return (
        [Rule(name, target, optional=True) for name in names]
        if optional or len(names) > 1
        else [Rule(names[0], target)]
    )


def _rules() -> tuple[Rule, ...]:
    """Transformers' names and DeepSeek's own (which Transformers' writer also produces), both under
    model.; a checkpoint without that root is read through FamilySpec.optional_prefix."""
    layer = "model.layers.{i}."
    attn = ("self_attn.", "attn.")
    # (Transformers' name, DeepSeek's) under the layer's attention -> the decoder's, after
    # layers.{i}.attn.
    names = [
        ("q_a_proj.weight", "wq_a.weight", "q_a.weight"),
        ("q_a_norm.weight", "q_norm.weight", "q_a_norm.weight"),
        ("q_b_proj.weight", "wq_b.weight", "q_b.weight"),
        ("kv_proj.weight", "wkv.weight", "kv.weight"),
        ("kv_norm.weight", "norm.weight", "kv_norm.weight"),
        ("o_a_proj.weight", "wo_a.weight", "o_a.weight"),
        ("o_b_proj.weight", "wo_b.weight", "o_b.weight"),
        ("sinks", "attn_sink", "sinks.weight"),
    ]
    compressed = []
    for theirs, own, target in (
        ("compressor.", "compressor.", "compressor."),
        ("compressor.indexer.", "indexer.compressor.", "indexer.compressor."),
    ):
        compressed += [
            (f"{theirs}kv_proj.weight", f"{own}wkv.weight", f"{target}kv.weight"),
            (f"{theirs}gate_proj.weight", f"{own}wgate.weight", f"{target}gate.weight"),
            (f"{theirs}position_bias", f"{own}ape", f"{target}position_bias.weight"),
            (f"{theirs}kv_norm.weight", f"{own}norm.weight", f"{target}kv_norm.weight"),
        ]
    compressed += [
        ("compressor.indexer.q_b_proj.weight", "indexer.wq_b.weight", "indexer.q_b.weight"),
        (
            "compressor.indexer.scorer.weights_proj.weight",
            "indexer.weights_proj.weight",
            "indexer.weights_proj.weight",
        ),
    ]
    rules: list[Rule] = []
    for group, optional in ((names, False), (compressed, True)):
        for theirs, own, target in group:
            rules += _spellings(
                f"layers.{{i}}.attn.{target}",
                f"{layer}{attn[0]}{theirs}",
                f"{layer}{attn[1]}{own}",
                optional=optional,
            )
    rules += _spellings("embed.weight", "model.embed_tokens.weight", "model.embed.weight")
    rules += _spellings("lm_head.weight", "lm_head.weight", "head.weight", "model.head.weight")
    rules += _spellings("final_norm.weight", "model.norm.weight")
    rules += _spellings(
        "layers.{i}.attn_norm.weight", f"{layer}input_layernorm.weight", f"{layer}attn_norm.weight"
    )
    rules += _spellings(
        "layers.{i}.mlp_norm.weight",
        f"{layer}post_attention_layernorm.weight",
        f"{layer}ffn_norm.weight",
    )
    for part in ("fn", "base", "scale"):
        rules += _spellings(
            f"layers.{{i}}.attn_hc.{part}", f"{layer}attn_hc.{part}", f"{layer}hc_attn_{part}"
        )
        rules += _spellings(
            f"layers.{{i}}.mlp_hc.{part}", f"{layer}ffn_hc.{part}", f"{layer}hc_ffn_{part}"
        )
        rules += _spellings(f"hc_head.{part}", f"model.hc_head.hc_{part}", f"model.hc_head_{part}")
    for mlp in ("mlp", "ffn"):
        rules += _spellings(
            "layers.{i}.mlp.router.tid2eid", f"{layer}{mlp}.gate.tid2eid", optional=True
        )
        rules += _spellings(
            "layers.{i}.mlp.router.weight", f"{layer}{mlp}.gate.weight", optional=True
        )
        rules += _spellings(
            ROUTER_CORRECTION,
            f"{layer}{mlp}.gate.e_score_correction_bias",
            f"{layer}{mlp}.gate.bias",
        )
    # the shared expert and the routed ones: Transformers' gate/up/down (the experts stacked),
    # DeepSeek's w1/w3/w2
    for theirs, own, target in (
        ("gate_proj", "w1", "gate"),
        ("up_proj", "w3", "up"),
        ("down_proj", "w2", "down"),
    ):
        rules += _spellings(
            f"layers.{{i}}.mlp.shared.{target}.weight",
            f"{layer}mlp.shared_experts.{theirs}.weight",
            f"{layer}ffn.shared_experts.{own}.weight",
        )
    return (
        tuple(rules)
        + expert_rules("model.layers.{i}.mlp")
        + expert_rules("model.layers.{i}.ffn", gate="w1", up="w3", down="w2")
    )


def attention_kinds(raw: dict, layers: int) -> list[str]:
    """layer_types, else older configs' compress_ratios, else DeepseekV4Config's pattern (two heavy
    layers, then sparse and heavy in turn)."""
    kinds = raw.get("v4_layer_types") or raw.get("layer_types")
    if not kinds and raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if set(ratios) - set(_RATIO_KIND):
            raise ConfigProblem(f"compress_ratios {ratios} name rates other than 0, 4 and 128")
        kinds = [_RATIO_KIND[r] for r in ratios]
    if not kinds:
        kinds = [HEAVY] * min(layers, 2) + [
            SPARSE if i % 2 else HEAVY for i in range(max(layers - 2, 0))
        ]
    kinds = list(kinds[:layers])
    if len(kinds) != layers or set(kinds) - {SLIDING, SPARSE, HEAVY}:
        raise ConfigProblem(
            f"layer_types must name {SLIDING}, {SPARSE} or {HEAVY} for each of the {layers} layers"
        )
    return kinds


def _compress_rope(raw: dict) -> dict:
    """The compressed layers' rotation, as DeepseekV4Config builds it: the rope_parameters' scaling
    (YaRN at attention factor one) at compress_rope_theta."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(params.get("compress"), dict):
        return dict(params["compress"])
    rope = {
        k: v
        for k, v in params.items()
        if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")
    }
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if rope["rope_type"] == "yarn":
        rope.setdefault("attention_factor", 1.0)
    return {**rope, "rope_theta": raw["compress_rope_theta"]}


def _deepseek_v4(raw: dict) -> dict:
    raw = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    layers = raw["num_hidden_layers"]
    head_dim = raw["head_dim"]
    rope_dim = raw.get("qk_rope_head_dim") or int(
        head_dim * (raw.get("partial_rotary_factor") or 64 / 512)
    )
    rates = dict(raw.get("compress_rates") or {SPARSE: 4, HEAVY: 128})
    rates[SPARSE] = raw.get("compress_rate_csa", rates.get(SPARSE, 4))
    rates[HEAVY] = raw.get("compress_rate_hca", rates.get(HEAVY, 128))
    mlp_kinds = raw.get("mlp_layer_types") or (
        ["hash_moe"] * min(layers, raw["num_hash_layers"])
        + ["moe"] * max(0, layers - raw["num_hash_layers"])
    )
    if len(mlp_kinds) < layers or set(mlp_kinds[:layers]) - {"hash_moe", "moe"}:
        raise ConfigProblem(
            f"mlp_layer_types must name hash_moe or moe for each of the {layers} layers"
        )
    streams = raw["hc_mult"]
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ConfigProblem(f"hc_mult is {streams!r}: state a positive number of residual streams")
    heads = raw["num_attention_heads"]
    # Transformers reshapes the heads' channels into o_groups
    if (heads * raw["head_dim"]) % raw["o_groups"]:
        raise ConfigProblem(
            f"{heads} attention heads of head_dim {raw['head_dim']} do not form o_groups "
            f"{raw['o_groups']} groups of whole channels"
        )
    out = {
        k: v
        for k, v in raw.items()
        if k
        not in (
            "layer_types",
            "rope_parameters",
            "rope_scaling",
            "sliding_window",
            "partial_rotary_factor",
            "mlp_layer_types",
        )
    }
    return {
        **out,
        "v4_layer_types": attention_kinds(raw, layers),
        "v4_compress_rates": rates,
        "v4_compress_rope": _compress_rope(raw),
        "v4_window": raw["sliding_window"],
        "qk_rope_head_dim": rope_dim,
        "v4_mlp_layer_types": list(mlp_kinds[:layers]),
        "num_key_value_heads": 1,
        "intermediate_size": raw["moe_intermediate_size"],
        # Transformers builds one shared expert moe_intermediate_size wide, whatever
        # n_shared_experts states
        "n_shared_experts": 1,
        "layer_moe_keys": [
            {"hash_routing_vocab": raw["vocab_size"]} if kind == "hash_moe" else {}
            for kind in mlp_kinds[:layers]
        ],
        "glu_limit_inside": raw["swiglu_limit"],
        "norm_topk_prob": True,
        "hyper_streams": streams,
        "hyper_mixing": True,
        "hyper_eps": raw["hc_eps"],
        "hyper_post_scale": 2.0,
        "hyper_post_eps": 0.0,
        "hyper_sinkhorn_iters": raw["hc_sinkhorn_iters"],
        "hyper_head": "weighted",
    }


def _layer_kinds(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ("compressed_attention",) * layers, ("moe",) * layers


DEEPSEEK_V4_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "deepseek_v4",
        _rules(),
        positions=PositionSpec(interleaved=True),
        normalize=_deepseek_v4,
        layer_kinds=_layer_kinds,
        parity_reference="DeepseekV4ForCausalLM",
        optional_prefix="model.",
        ignore=(r"(model\.)?mtp\..*",),
        refuse_keys={
            "quantization_config": "the published DeepSeek-V4 weights are FP8 and FP4, which are not "
            "read for this family; load a BF16 export"
        },
        moe=MoESpec(
            scoring="sqrtsoftplus",
            renormalize=True,
            scaling="always",
            correction_bias=True,
            shared="deepseek",
            activation="limited_swiglu",
        ),
    ),
)
