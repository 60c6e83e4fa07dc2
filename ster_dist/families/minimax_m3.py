"""MiniMax-M3's text decoder (minimax_m3_vl_text), read from a minimax_m3_vl checkpoint's
text_config below language_model (its vision tower never mapped), as Transformers'
MiniMaxM3VLTextModel runs it.

Every norm scales by its weight plus one, queries and keys are normed per head before rotating over
the rotated share of each head, and every feed-forward is SwiGLU-OAI: (clamp(up, +-limit) + 1) * g *
sigmoid(alpha g) with g = min(gate, limit) (the routed experts' clamped_swiglu, the dense and shared
ones' swiglu_oai). Layers moe_layer_freq (Transformers: mlp_layer_types) marks dense keep an mlp
dense_intermediate_size wide; the rest route sigmoid scores with e_score_correction_bias to choose,
renormalise, scale by routed_scaling_factor and add one shared expert shared_intermediate_size wide.
The layers sparse_attention_freq (Transformers: layer_types "minimax_m3_sparse") marks run MiniMax
Sparse Attention (model/block_sparse.py).

Both spellings are read: the release's (block_sparse_moe.experts.{e}.w1/w3/w2, gate_proj/up_proj,
self_attn.index_q_proj, sparse_attention_config, hidden_act swigluoai) and what Transformers writes
(mlp.experts.gate_up_proj, one gate_up_proj, self_attn.indexer.q_proj, flat index_* keys, and
hidden_act "silu", which Transformers' config writes whatever the release states and runs as
SwiGLU-OAI). The rotated share is rope_parameters' partial_rotary_factor where stated (Transformers
reads only it; its rotary_dim is a default it never uses), else rotary_dim over head_dim.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import ROUTER_CORRECTION, expert_rules, router_rules
from ster_dist.families.normalize import ConfigProblem
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    Fused,
    MoESpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)

_LAYER = "model.layers.{i}."
_SPARSE_KIND = "minimax_m3_sparse"


def _index_rules() -> tuple[Rule, ...]:
    rules = []
    for part, target in (
        ("q_proj", "index_q"),
        ("k_proj", "index_k"),
        ("q_norm", "index_q_norm"),
        ("k_norm", "index_k_norm"),
    ):
        for stored in (f"self_attn.index_{part}", f"self_attn.indexer.{part}"):
            rules.append(Rule(f"{_LAYER}{stored}.weight", f"layers.{{i}}.attn.{target}.weight"))
    return tuple(rules)


def _fused_gate_up(checkpoint: str, target: str, width: str) -> Rule:
    """Transformers' one gate_up_proj: the gate's rows, then the up projection's."""
    return Rule(
        checkpoint,
        Fused(((f"{target}.gate.weight", width), (f"{target}.up.weight", width)), unit="one"),
    )


_SHARED = "layers.{i}.mlp.shared"
_RULES = (
    llama_rules()
    + _index_rules()
    + (
        _fused_gate_up(f"{_LAYER}mlp.gate_up_proj.weight", "layers.{i}.mlp", "intermediate"),
        _fused_gate_up(
            f"{_LAYER}mlp.shared_experts.gate_up_proj.weight", _SHARED, "shared_intermediate"
        ),
        Rule(f"{_LAYER}mlp.shared_experts.down_proj.weight", f"{_SHARED}.down.weight"),
        Rule(f"{_LAYER}block_sparse_moe.e_score_correction_bias", ROUTER_CORRECTION),
    )
    + tuple(
        Rule(
            f"{_LAYER}block_sparse_moe.shared_experts.{name}_proj.weight",
            f"{_SHARED}.{name}.weight",
        )
        for name in ("gate", "up", "down")
    )
    + expert_rules(
        "model.layers.{i}.block_sparse_moe", "w1", "w3", "w2", stacked="model.layers.{i}.mlp"
    )
    + router_rules(f"{_LAYER}block_sparse_moe.gate")
    + router_rules(f"{_LAYER}mlp.gate")
)

# MiniMaxM3VLTextConfig's defaults for keys a config leaves out
_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "routed_scaling_factor": 2.0,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "dense_intermediate_size": 12288,
    "shared_intermediate_size": 3072,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_block_size": 128,
    "index_topk_blocks": 16,
    "index_local_blocks": 1,
}
_SPARSE_KEYS = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}


def _refuse(raw: dict, sparse: dict, released: bool) -> None:
    """The seed's refusals, each naming its key."""
    act = raw.get("hidden_act", "swigluoai")
    if act != "swigluoai" and (released or act != "silu"):
        raise ConfigProblem(
            f"hidden_act {act!r} is not supported; MiniMax-M3's feed-forwards are swigluoai"
        )
    for key, wanted in (
        ("attention_output_gate", False),
        ("use_gemma_norm", True),
        ("use_qk_norm", True),
    ):
        if key in raw and bool(raw[key]) != wanted:
            raise ConfigProblem(
                f"{key} is {raw[key]!r}; MiniMax-M3 is read with {key} {str(wanted).lower()} only"
            )
    for key, wanted, source in (
        ("qk_norm_type", "per_head", raw),
        ("scoring_func", "sigmoid", raw),
        ("sparse_score_type", "max", sparse),
    ):
        if source.get(key, wanted) != wanted:
            raise ConfigProblem(
                f"{key} {source[key]!r} is not supported; MiniMax-M3 is read with {key} {wanted}"
            )
    if sparse.get("sparse_init_block"):
        raise ConfigProblem(
            f"sparse_init_block is {sparse['sparse_init_block']!r}; leading always-kept blocks are "
            "not supported (state 0)"
        )


def _minimax_m3(raw: dict) -> dict:
    sparse = raw.get("sparse_attention_config") or {}
    released = bool(sparse) or "moe_layer_freq" in raw
    _refuse(raw, sparse, released)
    out = {
        **_DEFAULTS,
        **{k: v for k, v in raw.items() if k not in ("sparse_attention_config", "moe_layer_freq")},
    }
    out.update({flat: sparse[key] for key, flat in _SPARSE_KEYS.items() if key in sparse})
    layers = out.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return out  # the shared reader refuses the layer count itself
    types = out.get("layer_types")
    if "sparse_attention_freq" in sparse:
        types = [_SPARSE_KIND if f else "full_attention" for f in sparse["sparse_attention_freq"]]
    types = list(types or ["full_attention"] * layers)
    freq = raw.get("moe_layer_freq")
    mlp = list(
        out.get("mlp_layer_types")
        or (["sparse" if f else "dense" for f in freq] if freq is not None else ["sparse"] * layers)
    )
    if len(types) < layers or len(mlp) < layers:
        raise ConfigProblem(
            "layer_types and mlp_layer_types (sparse_attention_freq, moe_layer_freq) must list "
            "every layer"
        )
    off = sparse.get("sparse_disable_index_value", 1)
    offs = off if isinstance(off, list) else [off] * layers
    if any(types[i] == _SPARSE_KIND and not offs[i] for i in range(min(layers, len(offs)))):
        raise ConfigProblem(
            "sparse_disable_index_value is 0 on a sparse layer; the index value branch is not "
            "supported"
        )
    heads, index_heads = out.get("num_attention_heads"), out["index_n_heads"]
    if (
        isinstance(heads, int)
        and isinstance(index_heads, int)
        and not isinstance(index_heads, bool)
        and (index_heads < 1 or heads % index_heads)
    ):
        # Transformers' mask repeats each index head's choice over heads / index heads query heads
        raise ConfigProblem(
            f"sparse_num_index_heads is {index_heads} for {heads} attention heads; each index "
            "head chooses for a whole run of query heads, so it must divide them"
        )
    if (out.get("n_shared_experts") or 1) != 1:
        raise ConfigProblem(
            f"n_shared_experts is {out['n_shared_experts']}; one shared expert is supported"
        )
    rope = out.get("rope_parameters") if isinstance(out.get("rope_parameters"), dict) else {}
    partial = rope.get("partial_rotary_factor") or out.get("partial_rotary_factor")
    if partial is None and out.get("rotary_dim") is not None:
        partial = out["rotary_dim"] / out["head_dim"]
    out.pop("rotary_dim", None)
    # every layer attends in full as the rotation reader sees it; which of them choose blocks is the
    # layer's kind
    return {
        **out,
        "layer_types": ["full_attention"] * layers,
        "sparse_attention_layers": [t == _SPARSE_KIND for t in types[:layers]],
        "mlp_layer_types": mlp[:layers],
        "hidden_act": "silu",
        "partial_rotary_factor": partial or 1.0,
        "intermediate_size": out["dense_intermediate_size"],
        "moe_intermediate_size": raw.get("intermediate_size", 3072),
        "scoring_func": "sigmoid",
        "swiglu_oai": [out["swiglu_limit"], out["swiglu_alpha"]],
        "norm_topk_prob": True,
        "attention_bias": False,
        "mlp_bias": False,
    }


def _layer_kinds(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (
        tuple(
            "block_sparse_attention" if s else "attention" for s in raw["sparse_attention_layers"]
        ),
        tuple("moe" if m == "sparse" else "dense" for m in raw["mlp_layer_types"]),
    )


MINIMAX_M3_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "minimax_m3_vl_text",
        _RULES,
        normalize=_minimax_m3,
        layer_kinds=_layer_kinds,
        attention=AttentionSpec(qk_norm=QKNormSpec()),
        norms=NormSpec(offset=1.0),
        positions=PositionSpec(theta=5000000.0),
        moe=MoESpec(
            scoring="sigmoid",
            renormalize=True,
            scaling="always",
            correction_bias=True,
            shared="stated",
            activation="clamped_swiglu",
        ),
        parity_reference="MiniMaxM3VLForCausalLM",
        ignore=(r"model\.mtp\..*",),
    ),
)
