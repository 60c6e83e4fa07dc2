"""Mamba-2 and the hybrids Transformers builds from its mixer (model/mamba2.py): each normalisation
maps the family's own names for the mixer's settings onto Bamba's (mamba_n_heads, mamba_d_head,
...), which the mixer reads.

- mamba2: every layer a norm and a Mamba-2 mixer, no feed-forward (state-spaces' Mamba-2, Codestral
  Mamba).
- bamba: Llama's blocks whose token mixer is Mamba-2 except at attn_layer_indices, where it is
  attention rotating half of each head.
- nemotron_h: one norm and one sublayer per layer, as hybrid_override_pattern (or layers_block_type)
  says:
  M a Mamba-2 mixer, * attention without rotation, - a plain squared-ReLU feed-forward, E experts
  without a gate (moe/experts.py, activation "ungated") routed by sigmoid scores over groups
  (noaux_tc: groups ranked by their best two, e_score_correction_bias added only to choose),
  renormalised under norm_topk_prob and scaled by routed_scaling_factor, beside one ungated shared
  expert moe_shared_expert_intermediate_size wide; under moe_latent_size the routed experts work on
  fc1_latent_proj(x) and return through fc2_latent_proj. Its dt is clamped below at time_step_min,
  as Transformers does.

- nemotron_h_puzzle (Nemotron Puzzle): Nemotron-H below `model` rather than `backbone`, its layers
  listed in block_configs (block_type mamba, attention, mlp, moe; or layers_block_type), each moe
  block stating its own experts (n_routed_experts, num_experts_per_tok, moe_intermediate_size,
  moe_latent_size, ...), which its layer builds (ModelConfig.layer_moe). Any other per-block key is
  refused.

Codestral's config states norm_before_gate true; Transformers ignores it (the gate always multiplies
before the norm), and so does ster_dist.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.moe_layouts import EXPERTS, router_rules
from ster_dist.families.spec import FamilySpec, FeedForwardSpec, MoESpec, PositionSpec, Rule


def mamba2_mixer_rules(layer: str, into: str = "layers.{i}.mixer") -> tuple[Rule, ...]:
    """One Mamba-2 mixer's tensors under `layer` (a template with {i}), into `into`
    (layers.{i}.mixer)."""
    return (
        *(
            rule
            for name in ("in_proj", "conv1d", "out_proj")
            for rule in weight_and_bias(f"{layer}.{name}", f"{into}.{name}")
        ),
        Rule(f"{layer}.norm.weight", f"{into}.norm.weight"),
        *(Rule(f"{layer}.{name}", f"{into}.{name}") for name in ("A_log", "D", "dt_bias")),
    )


def _rename(raw: dict, names: dict[str, str], defaults: dict) -> dict:
    """raw with each family key's value (or Transformers' default where unstated) under the mixer's
    name."""
    out = dict(raw)
    for own, mixer in names.items():
        value = raw.get(own)
        out[mixer] = defaults[own] if value is None else value
    return out


# Mamba2Config's names and defaults
_MAMBA2_NAMES = {
    "num_heads": "mamba_n_heads",
    "head_dim": "mamba_d_head",
    "state_size": "mamba_d_state",
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "expand": "mamba_expand",
    "use_conv_bias": "mamba_conv_bias",
    "use_bias": "mamba_proj_bias",
    "hidden_act": "mamba_hidden_act",
}
_MAMBA2_DEFAULTS = {
    "num_heads": 128,
    "head_dim": 64,
    "state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "use_conv_bias": True,
    "use_bias": False,
    "hidden_act": "silu",
}


def _normalize_mamba2(raw: dict) -> dict:
    out = _rename(raw, _MAMBA2_NAMES, _MAMBA2_DEFAULTS)
    out.setdefault("layer_norm_epsilon", 1e-5)
    if isinstance(out.get("hidden_size"), int) and isinstance(out["mamba_expand"], int):
        out["intermediate_size"] = out["mamba_expand"] * out["hidden_size"]
    return out


def _every_layer_mamba2(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ("mamba2",) * layers, ("none",) * layers


# BambaConfig's defaults (its names are the mixer's); mamba_d_head "auto" is expand x hidden / heads
_BAMBA_DEFAULTS = {
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}


def bamba_mixer_keys(raw: dict) -> dict:
    """raw with Bamba's mamba_* keys filled as BambaConfig fills them (GraniteMoeHybridConfig has
    the same)."""
    out = _rename(raw, {key: key for key in _BAMBA_DEFAULTS}, _BAMBA_DEFAULTS)
    if out["mamba_d_head"] == "auto" and isinstance(out.get("hidden_size"), int):
        out["mamba_d_head"] = out["mamba_expand"] * out["hidden_size"] // out["mamba_n_heads"]
    out["mamba_hidden_act"] = raw.get("hidden_act") or "silu"
    return out


def _normalize_bamba(raw: dict) -> dict:
    out = bamba_mixer_keys(raw)
    for key, value in (
        ("rms_norm_eps", 1e-5),
        ("num_key_value_heads", 8),
        ("max_position_embeddings", 262144),
        ("partial_rotary_factor", 0.5),
    ):
        if out.get(key) is None:
            out[key] = value
    return out


def _bamba_layers(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    indices = raw.get("attn_layer_indices") or []
    if not isinstance(indices, list) or not all(
        isinstance(i, int) and 0 <= i < layers for i in indices
    ):
        raise Refusal(
            f"invalid model config: attn_layer_indices {indices!r} must list layer indices below "
            f"num_hidden_layers ({layers}); correct it"
        )
    return tuple("attention" if i in indices else "mamba2" for i in range(layers)), (
        "dense",
    ) * layers


MAMBA2_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "mamba2",
        (
            Rule("backbone.embeddings.weight", "embed.weight"),
            # the original checkpoints' name
            Rule("backbone.embedding.weight", "embed.weight"),
            Rule("lm_head.weight", "lm_head.weight"),
            Rule("backbone.norm_f.weight", "final_norm.weight"),
            Rule("backbone.layers.{i}.norm.weight", "layers.{i}.attn_norm.weight"),
            *mamba2_mixer_rules("backbone.layers.{i}.mixer"),
        ),
        normalize=_normalize_mamba2,
        layer_kinds=_every_layer_mamba2,
        parity_reference="Mamba2ForCausalLM",
    ),
    FamilySpec(
        "bamba",
        llama_rules(
            mlp="feed_forward",
            mlp_norm="pre_ff_layernorm",
            final_norm="final_layernorm",
            q_norm=None,
            k_norm=None,
        )
        + mamba2_mixer_rules("model.layers.{i}.mamba"),
        normalize=_normalize_bamba,
        layer_kinds=_bamba_layers,
        parity_reference="BambaForCausalLM",
    ),
)


# Nemotron-H's layer letters (hybrid_override_pattern) and names (layers_block_type, old and new) ->
# kinds
_NEMOTRON_H_KINDS = {
    "M": "mamba2",
    "mamba": "mamba2",
    "linear_attention": "mamba2",
    "*": "attention",
    "attention": "attention",
    "full_attention": "attention",
    "-": "none",
    "mlp": "none",
    "E": "moe",
    "moe": "moe",
}
# NemotronHConfig's names (its legacy spellings first) and defaults
_NEMOTRON_H_NAMES = {
    "mamba_num_heads": "mamba_n_heads",
    "mamba_head_dim": "mamba_d_head",
    "ssm_state_size": "mamba_d_state",
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "use_conv_bias": "mamba_conv_bias",
    "use_bias": "mamba_proj_bias",
    "mamba_hidden_act": "mamba_hidden_act",
}
_NEMOTRON_H_LEGACY = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_dt_min": "time_step_min",
}
_NEMOTRON_H_DEFAULTS = {
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "use_conv_bias": True,
    "use_bias": False,
    "mamba_hidden_act": "silu",
}


def _nemotron_h_pattern(raw: dict) -> list[str]:
    stated = raw.get("layers_block_type")
    if stated is None:
        stated = list(raw.get("hybrid_override_pattern") or "")
    if (
        not isinstance(stated, list)
        or not stated
        or not all(kind in _NEMOTRON_H_KINDS for kind in stated)
    ):
        raise Refusal(
            f"invalid model config: the Nemotron-H layer pattern {stated!r} is not a list of M, *, -, E "
            "(or their layers_block_type names); correct hybrid_override_pattern"
        )
    return [_NEMOTRON_H_KINDS[kind] for kind in stated]


def _normalize_nemotron_h(raw: dict) -> dict:
    # a legacy spelling wins over the current one, as NemotronHConfig reads them
    raw = {
        **raw,
        **{new: raw[old] for old, new in _NEMOTRON_H_LEGACY.items() if raw.get(old) is not None},
    }
    out = _rename(raw, _NEMOTRON_H_NAMES, _NEMOTRON_H_DEFAULTS)
    out["mamba_expand"] = None  # the mixer's width is its heads x head_dim, whatever expand says
    # the layer pattern decides the count (Transformers ignores a num_hidden_layers that disagrees)
    out["num_hidden_layers"] = len(_nemotron_h_pattern(raw))
    out["time_step_limit"] = [raw.get("time_step_min", 0.001), None]
    out["hidden_act"] = raw.get("mlp_hidden_act", "relu2")
    out["attention_bias"] = False  # Transformers' attention has no biases whatever the config says
    # the experts' routing as NemotronHConfig fills it; its one shared expert is this wide, whatever
    # n_shared_experts says
    for key, value in (
        ("n_routed_experts", 8),
        ("num_experts_per_tok", 2),
        ("moe_intermediate_size", 7688),
        ("norm_topk_prob", True),
        ("routed_scaling_factor", 1.0),
        ("n_group", 1),
        ("topk_group", 1),
    ):
        if out.get(key) is None:
            out[key] = value
    out["shared_intermediate_size"] = raw.get("moe_shared_expert_intermediate_size") or 7688
    for key, value in (
        ("layer_norm_epsilon", 1e-5),
        ("num_attention_heads", 32),
        ("num_key_value_heads", 8),
        ("head_dim", 128),
        ("intermediate_size", 21504),
        ("max_position_embeddings", 4096),
    ):
        out.setdefault(key, value)
    return out


def _nemotron_h_layers(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    kinds = _nemotron_h_pattern(raw)
    # a letter names the layer's one sublayer: a mixer (M, *) or a feed-forward (-, E) behind no
    # mixer
    mixers = tuple("none" if kind == "moe" else kind for kind in kinds)
    return mixers, tuple({"none": "dense", "moe": "moe"}.get(kind, "none") for kind in kinds)


_NEMOTRON_H_RULES = (
    Rule("backbone.embeddings.weight", "embed.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
    Rule("backbone.norm_f.weight", "final_norm.weight"),
    Rule("backbone.layers.{i}.norm.weight", "layers.{i}.attn_norm.weight"),
    *(
        rule
        for src, dst in (
            ("q_proj", "attn.q"),
            ("k_proj", "attn.k"),
            ("v_proj", "attn.v"),
            ("o_proj", "attn.o"),
            ("up_proj", "mlp.up"),
            ("down_proj", "mlp.down"),
        )
        for rule in weight_and_bias(f"backbone.layers.{{i}}.mixer.{src}", f"layers.{{i}}.{dst}")
    ),
    *mamba2_mixer_rules("backbone.layers.{i}.mixer"),
    # E layers: per-expert tensors, as published and as Transformers saves them (no gate anywhere)
    *(
        Rule(f"backbone.layers.{{i}}.mixer.experts.{{e}}.{name}_proj.weight", f"{EXPERTS}{name}")
        for name in ("up", "down")
    ),
    *router_rules("backbone.layers.{i}.mixer.gate"),
    *weight_and_bias("backbone.layers.{i}.mixer.fc1_latent_proj", "layers.{i}.mlp.latent_in"),
    *weight_and_bias("backbone.layers.{i}.mixer.fc2_latent_proj", "layers.{i}.mlp.latent_out"),
    *(
        rule
        for name in ("up", "down")
        for rule in weight_and_bias(
            f"backbone.layers.{{i}}.mixer.shared_experts.{name}_proj",
            f"layers.{{i}}.mlp.shared.{name}",
        )
    ),
)

# sigmoid scores grouped as DeepSeek-V3's (noaux_tc), always scaled, one shared expert of its stated
# width
_NEMOTRON_H_MOE = MoESpec(
    scoring="sigmoid",
    topk_method="noaux_tc",
    correction_bias=True,
    scaling="always",
    shared="stated",
    activation="ungated",
)

MAMBA2_FAMILIES += (
    FamilySpec(
        "nemotron_h",
        _NEMOTRON_H_RULES,
        positions=PositionSpec(kind="none"),
        feed_forward=FeedForwardSpec(gated=False),
        normalize=_normalize_nemotron_h,
        moe=_NEMOTRON_H_MOE,
        layer_kinds=_nemotron_h_layers,
        parity_reference="NemotronHForCausalLM",
    ),
)


# Nemotron Puzzle
# -------------------------------------------------------------------------------------------------

# the per-block keys an expert layer may state over the model's; anything else in a block is refused
_PUZZLE_MOE_KEYS = (
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_latent_size",
    "moe_shared_expert_intermediate_size",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
)


def _puzzle_blocks(raw: dict) -> list[dict]:
    blocks = raw.get("block_configs")
    if (
        not isinstance(blocks, list)
        or not blocks
        or not all(
            isinstance(b, dict) and b.get("block_type") in ("mamba", "attention", "mlp", "moe")
            for b in blocks
        )
    ):
        raise Refusal(
            "invalid model config: block_configs must list one block a layer, each with block_type "
            "mamba, attention, mlp or moe"
        )
    for i, block in enumerate(blocks):
        allowed = _PUZZLE_MOE_KEYS if block["block_type"] == "moe" else ()
        other = sorted(set(block) - {"block_type", *allowed})
        if other:
            raise Refusal(
                f"block_configs[{i}] ({block['block_type']}) states {', '.join(other)} per layer, which "
                "ster_dist does not build per layer; use a checkpoint whose blocks state only their "
                "experts' settings"
            )
    return blocks


def _normalize_nemotron_h_puzzle(raw: dict) -> dict:
    blocks = _puzzle_blocks(raw)
    out = dict(
        raw, layers_block_type=raw.get("layers_block_type") or [b["block_type"] for b in blocks]
    )
    if len(out["layers_block_type"]) != len(blocks):
        raise Refusal(
            f"invalid model config: layers_block_type lists {len(out['layers_block_type'])} layers but "
            f"block_configs {len(blocks)}; correct one of them"
        )
    # the model-wide expert keys Puzzle leaves to its blocks: the first expert block's
    first = next((b for b in blocks if b["block_type"] == "moe"), {})
    for key in _PUZZLE_MOE_KEYS:
        if out.get(key) is None and key in first:
            out[key] = first[key]
    out = _normalize_nemotron_h(out)
    out["layer_moe_keys"] = [
        _puzzle_moe_keys(b) if b["block_type"] == "moe" else None for b in blocks
    ]
    return out


def _puzzle_moe_keys(block: dict) -> dict:
    """A block's expert keys under the names the experts' reader knows (the shared expert's width
    renamed)."""
    own = {key: block[key] for key in _PUZZLE_MOE_KEYS if key in block}
    if "moe_shared_expert_intermediate_size" in own:
        own["shared_intermediate_size"] = own.pop("moe_shared_expert_intermediate_size")
    return own


MAMBA2_FAMILIES += (
    FamilySpec(
        "nemotron_h_puzzle",
        tuple(
            Rule(rule.checkpoint.replace("backbone.", "model.", 1), rule.target)
            for rule in _NEMOTRON_H_RULES
        ),
        positions=PositionSpec(kind="none"),
        feed_forward=FeedForwardSpec(gated=False),
        moe=_NEMOTRON_H_MOE,
        normalize=_normalize_nemotron_h_puzzle,
        layer_kinds=_nemotron_h_layers,
        parity_reference="tests/families/test_nemotron_h_puzzle.py",
    ),
)
