"""Families whose attention layers choose the keys each query reads, built on DeepSeek's latent
attention.

- dots3_note (Dots3-Note): DeepSeek-V3.2's block (families/deepseek.py) with two latent attentions
  picked by layer_types. full_attention layers keep the model's latent sizes and DeepSeek Sparse
  Attention's indexer (model/indexer.py, adjacent pairs rotating unless indexer_rope_interleave is
  false); sliding_attention layers run a dense latent attention of their own swa_* sizes and heads,
  scored over their own head width, rotated by swa_rope_theta and attending within
  sliding_window_size. Every layer norms the shared rotated key part before it rotates
  (k_rope_only_layernorm), multiplies both bottlenecks' normed outputs by sqrt(hidden / rank) under
  apply_mla_qkv_lora_rescale, and gates each head's output by sigmoid(g_proj(x)) (model/mla.py reads
  these switches). DeepSeek-V3's experts over one group unless stated, after first_k_dense_replace
  dense layers. Rotations use their plain base whatever rope_scaling states, as vLLM does. The image
  and audio towers and the MTP layer are never mapped.
"""

from __future__ import annotations

from dataclasses import replace

from ster_dist.families.deepseek import DEEPSEEK_RULES, DEEPSEEK_V3_ROUTER, INDEXER_RULES
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.spec import AttentionSpec, FamilySpec, PositionSpec, Rule

# Dots3NoteTextConfig's defaults (Transformers), under the released config's names
_DOTS3_DEFAULTS = {
    "vocab_size": 152064,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 46,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-5,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "first_k_dense_replace": 1,
    "indexer_rope_interleave": True,
    "apply_mla_qkv_lora_rescale": True,
    "shared_experts_intermediate_size": 1536,
    # the MTP layer stored after the decoder's (Transformers skips model.layers.46)
    "num_nextn_predict_layers": 1,
}
# the sliding layers' latent sizes (swa_<key>) and their defaults
_SWA_DEFAULTS = {
    "num_attention_heads": 64,
    "q_lora_rank": 1024,
    "kv_lora_rank": 1024,
    "head_dim": 256,
    "qk_nope_head_dim": 192,
    "v_head_dim": 128,
}
_LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _layer_types(raw: dict, layers: int) -> list[str]:
    """Dots3NoteTextConfig's derivation when unstated: full attention on the first two layers and
    every fourth from the second, the rest sliding (all full without use_sliding_window)."""
    kinds = raw.get("layer_types")
    if kinds:
        return list(kinds)
    sliding = stated(raw, "use_sliding_window", default=True)
    return [
        "full_attention" if not sliding or i < 2 or i % 4 == 1 else "sliding_attention"
        for i in range(layers)
    ]


def _theta(raw: dict, key: str, kinds: tuple[str, ...], default: float) -> float:
    """A layer kind's base: Transformers' per-kind rope_parameters where saved so, else the
    top-level key (the released config's), else a flat rope_parameters' (the full layers'), else
    Dots3NoteTextConfig's."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    for kind in kinds:
        if isinstance(params.get(kind), dict) and params[kind].get("rope_theta"):
            return float(params[kind]["rope_theta"])
    flat = params.get("rope_theta") if key == "rope_theta" else None
    return float(stated(raw, key, default=flat or default))


def _dots3_note(raw: dict) -> dict:
    raw = with_defaults(raw, _DOTS3_DEFAULTS)
    for key in ("attention_gate_type", "swa_attention_gate_type"):
        if stated(raw, key, default="headwise") != "headwise":
            raise ConfigProblem(
                f"{key} is {raw[key]!r}: only the headwise gate (one sigmoid per head) is "
                "supported; state headwise"
            )
    if not raw.get("q_lora_rank"):
        raise ConfigProblem(
            "q_lora_rank is null: Dots3-Note's queries and its indexer read a compressed query "
            "latent; state q_lora_rank"
        )
    layers = int(raw["num_hidden_layers"])
    kinds = _layer_types(raw, layers)
    if len(kinds) != layers or set(kinds) - {
        "full_attention",
        "indexed_attention",
        "sliding_attention",
    }:
        raise ConfigProblem(
            f"layer_types {kinds} must name full_attention (or indexed_attention) or "
            f"sliding_attention for each of the {layers} layers"
        )
    # the full layers run the indexer unless use_dsa says not (Transformers' two spellings of one
    # kind)
    indexed = stated(raw, "use_dsa", default=True) is not False
    swa = {key: stated(raw, f"swa_{key}", default=value) for key, value in _SWA_DEFAULTS.items()}
    swa["qk_rope_head_dim"] = stated(
        raw, "swa_qk_rope_head_dim", default=swa["head_dim"] - swa["qk_nope_head_dim"]
    )
    if swa["qk_rope_head_dim"] != raw["qk_rope_head_dim"]:
        raise ConfigProblem(
            f"swa_qk_rope_head_dim {swa['qk_rope_head_dim']} differs from qk_rope_head_dim "
            f"{raw['qk_rope_head_dim']}: sliding-window heads rotating another width than the "
            "full-attention ones are not supported"
        )
    if not swa["q_lora_rank"]:
        raise ConfigProblem(
            "swa_q_lora_rank is null: the sliding layers read a compressed query latent; state "
            "swa_q_lora_rank"
        )
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        if not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 1:
            raise ConfigProblem(f"{key} is {raw[key]!r}: state a positive integer")
    if indexed and raw["index_head_dim"] < raw["qk_rope_head_dim"]:
        raise ConfigProblem(
            f"index_head_dim {raw['index_head_dim']} is narrower than the rotated qk_rope_head_dim "
            f"{raw['qk_rope_head_dim']}: state an index_head_dim at least that wide"
        )
    slides = [kind == "sliding_attention" for kind in kinds]
    window = stated(raw, "sliding_window", "sliding_window_size", default=512)
    heads = int(raw["num_attention_heads"])
    shared = int(stated(raw, "n_shared_experts", default=0))
    width = stated(raw, "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size")
    # the plain base whatever rope_scaling states, as vLLM rotates
    rope = {
        "full_attention": {
            "rope_type": "default",
            "rope_theta": _theta(
                raw, "rope_theta", ("indexed_attention", "full_attention"), 80_000_000.0
            ),
        },
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": _theta(raw, "swa_rope_theta", ("sliding_attention",), 50_000.0),
        },
    }
    out = {k: v for k, v in raw.items() if k not in ("head_dim", "rope_scaling", "rope_theta")}
    return {
        **out,
        "mlp_bias": False,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in slides],
        "sliding_window": int(window) if any(slides) else None,
        "rope_parameters": rope,
        "layer_heads": [int(swa["num_attention_heads"]) if s else heads for s in slides],
        "layer_kv_heads": [int(swa["num_attention_heads"]) if s else heads for s in slides],
        "layer_latent": [{key: swa[key] for key in _LATENT_KEYS} if s else None for s in slides],
        "indexer_types": ["full" if indexed and not s else "none" for s in slides],
        "index_rope_interleave": bool(raw["indexer_rope_interleave"]),
        "rope_interleave": True,
        "latent_norm_eps": float(raw["rms_norm_eps"]),
        "k_rope_norm": True,
        "mla_head_gate": True,
        "mla_lora_rescale": bool(raw["apply_mla_qkv_lora_rescale"]),
        "shared_intermediate_size": int(width) * shared,
    }


_ATTN = "model.layers.{i}.self_attn"
_DOTS3_RULES = (
    DEEPSEEK_RULES
    + tuple(Rule(r.checkpoint, r.target, optional=True) for r in INDEXER_RULES)
    + (
        Rule(f"{_ATTN}.g_proj.weight", "layers.{i}.attn.head_gate.weight"),
        Rule(f"{_ATTN}.k_rope_only_layernorm.weight", "layers.{i}.attn.k_rope_norm.weight"),
    )
)

SPARSE_ATTENTION_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "dots3_note",
        _DOTS3_RULES,
        attention=AttentionSpec(latent=True),
        positions=PositionSpec(interleaved=True),
        normalize=_dots3_note,
        moe=replace(DEEPSEEK_V3_ROUTER, shared="stated"),
        ignore=(
            r"(model\.)?(vision_encoder|audio_encoder|audio_adapter|vision_tower|audio_tower)\..*",
            r"model\.mtp\..*",
        ),
        parity_reference="Dots3NoteForCausalLM",
    ),
)
