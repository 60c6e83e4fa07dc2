"""Zamba2: Mamba-2 layers, and at the layers layers_block_type marks "hybrid" a transformer block
that several layers share, fed the hidden state beside the embeddings (model/shared_block.py, the
"mamba2_shared_block" kind).

The normalisation maps Zamba2Config's names for the Mamba-2 layer onto Bamba's (model/mamba2.py),
with Transformers' fixed choices: the conv1d always biased, the gated norm's epsilon 1e-5, dt
clamped below at time_step_min (Transformers clamps it when it reads a prompt, not in its one-token
step; the two agree unless softplus(dt) falls below time_step_min). The shared attention's heads are
2 * hidden / heads wide, its scores scaled by (head width / 2)^-1/2 (query_pre_attn_scalar), rotated
only under use_mem_rope; add_bias_linear biases the Mamba-2 and feed-forward projections, never
attention's.

Checkpoint names: a block's weights (and every adapter slot of it) are stored under its first hybrid
layer, model.layers.{i}.shared_transformer; a checkpoint that also stores the tied copies has them
skipped (shard/plan.py), so each rank reads the block once. Transformers ties the blocks only under
tie_word_embeddings; a config with it false has a block per hybrid layer, each stored and read under
its own layer.
"""

from __future__ import annotations

from ster_dist.families.layouts import weight_and_bias
from ster_dist.families.mamba2 import mamba2_mixer_rules
from ster_dist.families.normalize import ConfigProblem, with_defaults
from ster_dist.families.spec import EmbeddingSpec, FamilySpec, Fused, Rule

# Zamba2Config's defaults for the keys the normalisation reads
_DEFAULTS = {
    "hidden_size": 2560,
    "mamba_d_state": 64,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_ngroups": 1,
    "n_mamba_heads": 8,
    "add_bias_linear": False,
    "hidden_act": "gelu",
    "num_attention_heads": 32,
    "num_mem_blocks": 1,
    "use_shared_attention_adapter": False,
    "adapter_rank": 128,
    "use_mem_rope": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "vocab_size": 32000,
    "time_step_min": 0.001,
}
# Zamba2Config's layer pattern when none is stated (54 layers)
_DEFAULT_PATTERN = (
    ["mamba"]
    + (["mamba"] * 5 + ["hybrid"]) * 7
    + ["mamba"] * 4
    + ["hybrid"]
    + ["mamba"] * 3
    + ["hybrid"]
    + ["mamba"] * 2
)
# layers_block_type's names, Transformers' legacy ones included
_KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "hybrid": "mamba2_shared_block"}


def _pattern(raw: dict) -> list[str]:
    stated = raw.get("layers_block_type")
    if stated is None:
        return list(_DEFAULT_PATTERN)
    if not isinstance(stated, list) or not stated or not all(kind in _KINDS for kind in stated):
        raise ConfigProblem(
            f'layers_block_type {stated!r} is not a list of "mamba" and "hybrid"; correct it'
        )
    return stated


def _normalize(raw: dict) -> dict:
    out = with_defaults(raw, _DEFAULTS)
    pattern = _pattern(out)
    hidden, heads, attention_heads = (
        out["hidden_size"],
        out["n_mamba_heads"],
        out["num_attention_heads"],
    )
    # Transformers' alias of layers_block_type, not attention's layer types
    out.pop("layer_types", None)
    # Transformers builds one layer per entry, whatever the count says
    out["num_hidden_layers"] = len(pattern)
    out["shared_block_layers"] = [i for i, kind in enumerate(pattern) if kind == "hybrid"]
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        out["mamba_d_head"] = int(out["mamba_expand"] * hidden) // heads
    out.update(
        mamba_n_heads=heads,
        mamba_d_state=out["mamba_d_state"],
        mamba_n_groups=out["mamba_ngroups"],
        mamba_d_conv=out["mamba_d_conv"],
        mamba_conv_bias=True,
        mamba_proj_bias=out["add_bias_linear"],
        mamba_hidden_act="silu",
        mamba_norm_eps=1e-5,
        time_step_limit=[out["time_step_min"], None],
        mlp_bias=out["add_bias_linear"],
        attention_bias=False,
    )
    if out.get("intermediate_size") is None and isinstance(hidden, int):
        out["intermediate_size"] = 4 * hidden
    if isinstance(hidden, int) and isinstance(attention_heads, int) and attention_heads > 0:
        # the shared block reads [hidden state, embeddings]: 2 * hidden / heads wide unless the
        # config states a
        # width (Transformers' attention_head_dim, or head_dim mapped onto it), which then wins as
        # it does there
        stated = out.get("attention_head_dim", out.get("head_dim"))
        out["head_dim"] = (
            stated
            if isinstance(stated, int) and not isinstance(stated, bool) and stated > 0
            else 2 * hidden // attention_heads
        )
        out["query_pre_attn_scalar"] = out["head_dim"] / 2
    if not out["use_mem_rope"]:
        out["no_rope_layers"] = [0] * len(pattern)
    return out


def _layers(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(_KINDS[kind] for kind in _pattern(raw)), ("none",) * layers


_LAYER, _SHARED, _INTO = (
    "model.layers.{i}.",
    "model.layers.{i}.shared_transformer.",
    "layers.{i}.mixer.shared.",
)


def _adapter_rules(stored: str, into: str) -> tuple[Rule, ...]:
    """One adapter slot ({s}) of a shared block: Sequential(A, B) stored as .0 and .1."""
    return (
        Rule(f"{stored}.{{s}}.0.weight", f"{into}.{{s}}.a"),
        Rule(f"{stored}.{{s}}.1.weight", f"{into}.{{s}}.b"),
    )


def _gate_up(suffix: str) -> Fused:
    return Fused(
        (
            (f"{_INTO}mlp.gate.{suffix}", "intermediate"),
            (f"{_INTO}mlp.up.{suffix}", "intermediate"),
        ),
        unit="one",
    )


_RULES = (
    Rule("model.embed_tokens.weight", "embed.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
    Rule("model.final_layernorm.weight", "final_norm.weight"),
    # the Mamba-2 layers
    Rule(f"{_LAYER}input_layernorm.weight", "layers.{i}.attn_norm.weight"),
    *mamba2_mixer_rules(f"{_LAYER}mamba"),
    # the hybrid layers: their own Mamba-2 layer, norm and linear, and the shared block
    Rule(f"{_LAYER}mamba_decoder.input_layernorm.weight", "layers.{i}.mixer.norm.weight"),
    *mamba2_mixer_rules(f"{_LAYER}mamba_decoder.mamba", into="layers.{i}.mixer.mamba"),
    Rule(f"{_LAYER}linear.weight", "layers.{i}.mixer.linear.weight"),
    Rule(f"{_SHARED}input_layernorm.weight", f"{_INTO}attn_norm.weight"),
    Rule(f"{_SHARED}pre_ff_layernorm.weight", f"{_INTO}mlp_norm.weight"),
    *(Rule(f"{_SHARED}self_attn.{p}_proj.weight", f"{_INTO}attn.{p}.weight") for p in "qkvo"),
    *(
        rule
        for p in "qkv"
        for rule in _adapter_rules(
            f"{_SHARED}self_attn.linear_{p}_adapter_list", f"{_INTO}{p}_adapters"
        )
    ),
    Rule(f"{_SHARED}feed_forward.gate_up_proj.weight", _gate_up("weight")),
    Rule(f"{_SHARED}feed_forward.gate_up_proj.bias", _gate_up("bias")),
    *weight_and_bias(f"{_SHARED}feed_forward.down_proj", f"{_INTO}mlp.down"),
    *_adapter_rules(f"{_SHARED}feed_forward.gate_up_proj_adapter_list", f"{_INTO}gate_up_adapters"),
)

ZAMBA2_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "zamba2",
        _RULES,
        embedding=EmbeddingSpec(tied=True),
        normalize=_normalize,
        layer_kinds=_layers,
        refuse_keys={
            "use_long_context": "Zamba2's long-context rotation is not supported; set it false"
        },
        require_values={
            "use_shared_mlp_adapter": (
                True,
                "Transformers' Zamba2 always applies its feed-forward adapters; set it true",
            )
        },
        parity_reference="Zamba2ForCausalLM",
    ),
)
