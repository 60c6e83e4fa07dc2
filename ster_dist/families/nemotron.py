"""Nemotron and the families Transformers builds from its feed-forward (Llama's attention over a
plain down(act(up(x))) with no gate), and NVIDIA's Nemotron-NAS.

- nemotron: LayerNorm1P (a biased LayerNorm whose scale is stored as an offset from one), squared
  ReLU, half of each head rotated.
- arcee: Nemotron's squared-ReLU feed-forward under Llama's RMS norms.
- jais2: Arcee's feed-forward under biased LayerNorms, every projection biased by default.
- nemotron-nas (DeciLM: Llama-3.3-Nemotron Super and Ultra, remote code): Llama's block in which
  every layer follows its own block_configs entry: num_attention_heads / n_heads_in_group key-value
  heads and a feed-forward 2 * ffn_mult * hidden_size / 3 wide rounded up to a multiple of 256 (or
  the entry's intermediate_size), as the per-layer keys layer_kv_heads and layer_intermediate_size.
  An entry whose attention or ffn is no_op has no such half (no norm, no weights: the layer-kind
  "none"), and the residual passes through it; its feed-forward's norm, post_attention_layernorm, is
  then the block's only norm. Checked against the reference written in
  tests/families/test_step1_nemotron_nas_k2_horizon.py from seeds/000's description.
- apertus: an xIELU feed-forward (four stored numbers per layer) without biases, per-head query/key
  norms, norms named for their sublayers.

InternLM3 has no spec: the installed Transformers ships only its config class, so there is no
reference to check parity against.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.normalize import ConfigProblem, defaults, stated, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    FeedForwardSpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)

# a plain feed-forward: down(act(up(x))), squared ReLU unless the config says otherwise
_PLAIN = llama_rules(gate=None, q_norm=None, k_norm=None)
_UNGATED = FeedForwardSpec(gated=False)
# what Transformers' config classes assume where a config is silent
_APERTUS_DEFAULTS = {
    "hidden_act": "xielu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 65536,
    "pad_token_id": 3,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 12_000_000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
}
# xIELU's stored numbers, each layer's own
_XIELU = tuple(
    Rule(f"model.layers.{{i}}.mlp.act_fn.{name}", f"layers.{{i}}.mlp.act.{name}")
    for name in ("alpha_p", "alpha_n", "beta", "eps")
)


def _jais2(raw: dict) -> dict:
    """Every projection biased unless attention_bias / mlp_bias say not."""
    raw = with_defaults(raw, {"hidden_act": "relu2", "layer_norm_eps": 1e-5})
    return {
        **raw,
        "attention_bias": bool(stated(raw, "attention_bias", default=True)),
        "mlp_bias": bool(stated(raw, "mlp_bias", default=True)),
    }


# what DeciLMConfig (LlamaConfig's defaults) assumes where a config is silent
_DECI_DEFAULTS = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "mlp_bias": False,
}
_DECI_REFUSED = (
    ("attention", "replace_with_linear", "a linear layer in place of attention is not supported"),
    ("attention", "sparsify", "sparsified attention is not supported"),
    ("attention", "window_length", "attention within a window is not supported"),
    ("attention", "num_sink_tokens", "attention sink tokens are not supported"),
    ("ffn", "replace_with_linear", "a linear layer in place of the feed-forward is not supported"),
    ("ffn", "sparsify", "a sparsified feed-forward is not supported"),
)


def _ffn_width(ffn_mult: float, hidden: int) -> int:
    """DeciLM's width for ffn_mult: 2 * ffn_mult * hidden / 3, truncated, then rounded up to a
    multiple of 256."""
    width = int(2 * ffn_mult * hidden / 3)
    return -(-width // 256) * 256


def _deci_blocks(raw: dict) -> list[tuple[dict, dict]]:
    """Each layer's (attention, ffn) entries, checked: one entry a layer, nothing the decoder cannot
    run."""
    blocks, layers = raw.get("block_configs"), raw.get("num_hidden_layers")
    if (
        not isinstance(blocks, list)
        or not all(isinstance(b, dict) for b in blocks)
        or (isinstance(layers, int) and len(blocks) != layers)
    ):
        # a Refusal, not a ConfigProblem: without its entries no layer of the model can be read at
        # all
        raise Refusal(
            f"invalid model config: block_configs must list one entry ({{attention, ffn}}) for each of "
            f"the {layers} layers; correct block_configs or num_hidden_layers"
        )
    out = []
    for i, block in enumerate(blocks):
        if block.get("parallel_blocks") is not None:
            raise ConfigProblem(
                f"block_configs[{i}] states parallel_blocks, which is not supported; use a "
                "checkpoint whose layers are attention and ffn entries"
            )
        attention, ffn = block.get("attention") or {}, block.get("ffn") or {}
        for half, key, why in _DECI_REFUSED:
            if (attention if half == "attention" else ffn).get(key):
                raise ConfigProblem(
                    f"block_configs[{i}].{half}.{key} is set: {why}; use a checkpoint without it"
                )
        act = ffn.get("hidden_act")
        if act is not None and act != raw["hidden_act"]:
            raise ConfigProblem(
                f"block_configs[{i}].ffn.hidden_act {act!r} differs from the model's hidden_act "
                f"{raw['hidden_act']!r}; a per-layer activation is not supported"
            )
        out.append((attention, ffn))
    return out


def _nemotron_nas(raw: dict) -> dict:
    """block_configs as per-layer key-value heads and feed-forward widths; the layer kinds say which
    halves exist."""
    raw = with_defaults(raw, _DECI_DEFAULTS)
    heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
    if (
        isinstance(heads, bool)
        or not isinstance(heads, int)
        or isinstance(hidden, bool)
        or not isinstance(hidden, int)
    ):
        return raw  # the shared reader refuses the sizes themselves
    blocks, kv_heads, widths = _deci_blocks(raw), [], []
    for i, (attention, ffn) in enumerate(blocks):
        group = attention.get("n_heads_in_group")
        if attention.get("no_op"):
            group = heads  # no attention: a placeholder count the layer never builds
        elif isinstance(group, bool) or not isinstance(group, int) or group < 1 or heads % group:
            raise ConfigProblem(
                f"block_configs[{i}].attention.n_heads_in_group is {group!r}; state a divisor of "
                f"num_attention_heads {heads}"
            )
        kv_heads.append(heads // group)
        width = stated(ffn, "intermediate_size")
        if width is None and not ffn.get("no_op"):
            mult = ffn.get("ffn_mult")
            if isinstance(mult, bool) or not isinstance(mult, (int, float)) or mult <= 0:
                raise ConfigProblem(
                    f"block_configs[{i}].ffn states neither intermediate_size nor a positive "
                    "ffn_mult; state one"
                )
            width = _ffn_width(mult, hidden)
        widths.append(width)
    fallback = max((w for w in widths if w), default=4 * hidden)
    widths = [w or fallback for w in widths]  # no_op feed-forwards: a placeholder width never built
    attending = [kv for kv, (attention, _) in zip(kv_heads, blocks) if not attention.get("no_op")]
    return {
        **raw,
        "num_key_value_heads": attending[0] if attending else heads,
        "intermediate_size": fallback,
        "layer_kv_heads": kv_heads,
        "layer_intermediate_size": widths,
    }


def _nemotron_nas_layers(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    blocks = _deci_blocks(raw)
    return (
        tuple("none" if attention.get("no_op") else "attention" for attention, _ in blocks),
        tuple("none" if ffn.get("no_op") else "dense" for _, ffn in blocks),
    )


NEMOTRON_FAMILIES: tuple[FamilySpec, ...] = (
    # LayerNorm1P: a biased LayerNorm whose scale is stored as an offset from one; half of each head
    # rotates
    FamilySpec(
        "nemotron",
        _PLAIN,
        norms=NormSpec(kind="layer", bias=True, offset=1.0),
        feed_forward=_UNGATED,
        positions=PositionSpec(rotary_share=0.5),
        normalize=defaults({"hidden_act": "relu2", "norm_eps": 1e-5}),
        parity_reference="NemotronForCausalLM",
    ),
    FamilySpec(
        "arcee",
        _PLAIN,
        feed_forward=_UNGATED,
        normalize=defaults({"hidden_act": "relu2", "rms_norm_eps": 1e-5}),
        parity_reference="ArceeForCausalLM",
    ),
    # Jais 2: Arcee's plain squared-ReLU feed-forward under biased LayerNorms; biases on by default
    FamilySpec(
        "jais2",
        _PLAIN,
        norms=NormSpec(kind="layer", bias=True),
        feed_forward=_UNGATED,
        normalize=_jais2,
        parity_reference="Jais2ForCausalLM",
    ),
    # Apertus: per-head query/key norms, norms named for their sublayers, a plain xIELU feed-forward
    # without biases
    FamilySpec(
        "apertus",
        llama_rules(gate=None, attn_norm="attention_layernorm", mlp_norm="feedforward_layernorm")
        + _XIELU,
        attention=AttentionSpec(qk_norm=QKNormSpec("head")),
        feed_forward=_UNGATED,
        positions=PositionSpec(theta=12_000_000.0),
        normalize=defaults(_APERTUS_DEFAULTS),
        parity_reference="ApertusForCausalLM",
    ),
    # a layer without attention keeps its feed-forward's norm, post_attention_layernorm, as the
    # block's only one
    FamilySpec(
        "nemotron-nas",
        llama_rules(q_norm=None, k_norm=None)
        + (
            Rule("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.attn_norm.weight"),
        ),
        normalize=_nemotron_nas,
        layer_kinds=_nemotron_nas_layers,
        parity_reference="tests/families/test_step1_nemotron_nas_k2_horizon.py",
    ),
)
