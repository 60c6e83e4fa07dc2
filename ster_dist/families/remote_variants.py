"""Llama-like families published as remote code on the Hub (no Transformers class) whose difference from Llama
is a position bias or per-layer data, as data.

- step1 (Step1, Step-Audio's language model): Llama's block with num_attention_groups key-value heads and no
  rotation; each head adds -slope * sqrt(query position - key position) to its scaled scores, with ALiBi's
  slopes (PositionSpec.alibi_sqrt).
- nemotron-nas (DeciLM: Llama-3.3-Nemotron Super and Ultra): Llama's block in which every layer follows its own
  block_configs entry: num_attention_heads / n_heads_in_group key-value heads and a feed-forward
  2 * ffn_mult * hidden_size / 3 wide rounded up to a multiple of 256 (or the entry's intermediate_size), as the
  per-layer keys layer_kv_heads and layer_intermediate_size. An entry whose attention or ffn is no_op has no such
  half (no norm, no weights: the layer-kind "none"), and the residual passes through it; its feed-forward's
  norm, post_attention_layernorm, is then the block's only norm.

ster_dist never runs their remote code: each is checked against the reference written in
tests/test_remote_variants.py from seeds/000's description.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.spec import FamilySpec, PositionSpec, Rule

_REFERENCE = "tests/test_remote_variants.py"
_LLAMA = llama_rules(q_norm=None, k_norm=None)


def _step1(raw: dict) -> dict:
    """num_attention_groups as the key-value head count."""
    groups = raw.get("num_attention_groups")
    return dict(raw) if groups is None else {**raw, "num_key_value_heads": groups}


# what DeciLMConfig (LlamaConfig's defaults) assumes where a config is silent
_DECI_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "mlp_bias": False}
_DECI_REFUSED = (
    ("attention", "replace_with_linear", "a linear layer in place of attention is not supported"),
    ("attention", "sparsify", "sparsified attention is not supported"),
    ("attention", "window_length", "attention within a window is not supported"),
    ("attention", "num_sink_tokens", "attention sink tokens are not supported"),
    ("ffn", "replace_with_linear", "a linear layer in place of the feed-forward is not supported"),
    ("ffn", "sparsify", "a sparsified feed-forward is not supported"),
)


def _ffn_width(ffn_mult: float, hidden: int) -> int:
    """DeciLM's width for ffn_mult: 2 * ffn_mult * hidden / 3, truncated, then rounded up to a multiple of 256."""
    width = int(2 * ffn_mult * hidden / 3)
    return -(-width // 256) * 256


def _deci_blocks(raw: dict) -> list[tuple[dict, dict]]:
    """Each layer's (attention, ffn) entries, checked: one entry a layer, nothing the decoder cannot run."""
    blocks, layers = raw.get("block_configs"), raw.get("num_hidden_layers")
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks) or (
            isinstance(layers, int) and len(blocks) != layers):
        # a Refusal, not a ConfigProblem: without its entries no layer of the model can be read at all
        raise Refusal(f"invalid model config: block_configs must list one entry ({{attention, ffn}}) for each of "
                      f"the {layers} layers; correct block_configs or num_hidden_layers")
    out = []
    for i, block in enumerate(blocks):
        if block.get("parallel_blocks") is not None:
            raise ConfigProblem(f"block_configs[{i}] states parallel_blocks, which is not supported; use a "
                                "checkpoint whose layers are attention and ffn entries")
        attention, ffn = block.get("attention") or {}, block.get("ffn") or {}
        for half, key, why in _DECI_REFUSED:
            if (attention if half == "attention" else ffn).get(key):
                raise ConfigProblem(f"block_configs[{i}].{half}.{key} is set: {why}; use a checkpoint without it")
        act = ffn.get("hidden_act")
        if act is not None and act != raw["hidden_act"]:
            raise ConfigProblem(f"block_configs[{i}].ffn.hidden_act {act!r} differs from the model's hidden_act "
                                f"{raw['hidden_act']!r}; a per-layer activation is not supported")
        out.append((attention, ffn))
    return out


def _nemotron_nas(raw: dict) -> dict:
    """block_configs as per-layer key-value heads and feed-forward widths; the layer kinds say which halves exist."""
    raw = with_defaults(raw, _DECI_DEFAULTS)
    heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
    if isinstance(heads, bool) or not isinstance(heads, int) or isinstance(hidden, bool) or not isinstance(
            hidden, int):
        return raw  # the shared reader refuses the sizes themselves
    kv_heads, widths = [], []
    for i, (attention, ffn) in enumerate(_deci_blocks(raw)):
        group = attention.get("n_heads_in_group")
        if attention.get("no_op"):
            group = heads  # no attention: a placeholder count the layer never builds
        elif isinstance(group, bool) or not isinstance(group, int) or group < 1 or heads % group:
            raise ConfigProblem(f"block_configs[{i}].attention.n_heads_in_group is {group!r}; state a divisor of "
                                f"num_attention_heads {heads}")
        kv_heads.append(heads // group)
        width = stated(ffn, "intermediate_size")
        if width is None and not ffn.get("no_op"):
            mult = ffn.get("ffn_mult")
            if isinstance(mult, bool) or not isinstance(mult, (int, float)) or mult <= 0:
                raise ConfigProblem(f"block_configs[{i}].ffn states neither intermediate_size nor a positive "
                                    "ffn_mult; state one")
            width = _ffn_width(mult, hidden)
        widths.append(width)
    fallback = max((w for w in widths if w), default=4 * hidden)
    widths = [w or fallback for w in widths]  # no_op feed-forwards: a placeholder width never built
    attending = [kv for kv, (attention, _) in zip(kv_heads, _deci_blocks(raw)) if not attention.get("no_op")]
    return {**raw, "num_key_value_heads": attending[0] if attending else heads, "intermediate_size": fallback,
            "layer_kv_heads": kv_heads, "layer_intermediate_size": widths}


def _nemotron_nas_layers(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    blocks = _deci_blocks(raw)
    return (tuple("none" if attention.get("no_op") else "attention" for attention, _ in blocks),
            tuple("none" if ffn.get("no_op") else "dense" for _, ffn in blocks))


REMOTE_VARIANTS_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("step1", _LLAMA, positions=PositionSpec(kind="alibi", alibi_sqrt=True), normalize=_step1,
               parity_reference=_REFERENCE),
    # a layer without attention keeps its feed-forward's norm, post_attention_layernorm, as the block's only one
    FamilySpec("nemotron-nas", _LLAMA + (Rule("model.layers.{i}.post_attention_layernorm.weight",
                                              "layers.{i}.attn_norm.weight"),),
               normalize=_nemotron_nas, layer_kinds=_nemotron_nas_layers, parity_reference=_REFERENCE),
)
