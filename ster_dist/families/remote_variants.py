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
- k2_horizon (K2-Horizon): Llama's block whose hidden-width RMS norms normalise layernorm_num_groups equal groups
  apart (norm_groups), every attention projection biased under attention_bias, and under attention_gate_func
  attention's output times silu or log2(1 + 2^g) of self_attn.gate_proj (output_gate_func). The layers neither in
  mlp_only_layers nor off decoder_sparse_step route over num_experts experts by router_score_func scores, which
  mlp.gate.bias moves only to choose under moe_gate_bias (noaux_tc over one group), renormalised under
  norm_topk_prob and scaled by router_scaling_factor, beside num_shared_experts shared ones. Under
  mova_num_experts those layers' values come from value experts (value_expert_keys: model/value_experts.py),
  routed by self_attn.v_router the same way except that their weights are renormalised whenever
  mova_num_experts_per_tok > 1 (as K2-Horizon's own code does); they have no v_proj, so no value adapter has a
  place there. Unstated keys take K2HorizonConfig's defaults (num_experts 0: a dense model).

ster_dist never runs their remote code: each is checked against the reference written in
tests/test_remote_variants.py from seeds/000's description.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import ROUTER_CORRECTION, expert_rules, shared_rules
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.spec import FamilySpec, MoESpec, PositionSpec, Rule

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
    blocks, kv_heads, widths = _deci_blocks(raw), [], []
    for i, (attention, ffn) in enumerate(blocks):
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
    attending = [kv for kv, (attention, _) in zip(kv_heads, blocks) if not attention.get("no_op")]
    return {**raw, "num_key_value_heads": attending[0] if attending else heads, "intermediate_size": fallback,
            "layer_kv_heads": kv_heads, "layer_intermediate_size": widths}


def _nemotron_nas_layers(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    blocks = _deci_blocks(raw)
    return (tuple("none" if attention.get("no_op") else "attention" for attention, _ in blocks),
            tuple("none" if ffn.get("no_op") else "dense" for _, ffn in blocks))


# what K2HorizonConfig (IFM's configuration class) assumes where a config is silent
_K2_DEFAULTS = {
    "head_dim": 64, "rms_norm_eps": 1e-6, "attention_bias": False, "use_sliding_window": False,
    "layernorm_num_groups": 1, "query_key_norm": False, "attention_gate_func": None, "num_experts": 0,
    "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8, "norm_topk_prob": False,
    "moe_gate_bias": False, "num_shared_experts": 0, "router_score_func": "softmax", "mova_num_experts": 0,
    "mova_num_experts_per_tok": 0, "tie_word_embeddings": False,
}
# its rotation where a config states neither rope_parameters nor rope_scaling (the base is PositionSpec.theta)
_K2_ROPE = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192,
            "attention_factor": 1.2772588722239782, "beta_fast": 128.0, "beta_slow": 4.0, "truncate": True}
_K2_GATES = {None: "none", "silu": "silu", "softplus": "softplus_ln2"}


def _k2_horizon(raw: dict) -> dict:
    """K2-Horizon's keys as the generic ones; its router as noaux_tc over one group when the gate's bias chooses."""
    raw = with_defaults(raw, _K2_DEFAULTS)
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        raw = {**raw, "rope_parameters": {**_K2_ROPE, "rope_theta": 1_000_000.0}}
    if raw.get("use_sliding_window"):
        raise ConfigProblem("use_sliding_window is set: K2-Horizon's sliding window is not supported; use a config "
                            "with it false")
    if raw.get("query_key_norm"):
        raise ConfigProblem("query_key_norm is set: K2-Horizon's grouped query/key norms are not supported; use a "
                            "config with it false")
    rope, head = raw.get("rope_head_dim"), raw.get("head_dim")
    if rope is not None and rope != head:
        raise ConfigProblem(f"rope_head_dim {rope} is narrower than head_dim {head}: a partial rotation of "
                            "K2-Horizon's layout is not supported; use a config rotating the whole head")
    gate = raw.get("attention_gate_func")
    if gate not in _K2_GATES:
        raise ConfigProblem(f"attention_gate_func {gate!r} is not supported; supported: silu, softplus, null")
    chooses = bool(raw.get("moe_gate_bias"))
    scaling = raw.get("router_scaling_factor")
    # the class drops a stated window unless use_sliding_window
    out = {**raw, "sliding_window": None, "norm_groups": raw["layernorm_num_groups"],
           "output_gate_func": _K2_GATES[gate],
           "mlp_bias": False, "scoring_func": raw["router_score_func"],
           "topk_method": "noaux_tc" if chooses else "greedy", "n_group": 1, "topk_group": 1,
           "routed_scaling_factor": 1.0 if scaling is None else scaling,
           "n_shared_experts": raw["num_shared_experts"]}
    if raw.get("mova_num_experts"):
        # the value router renormalises whenever it chooses more than one expert, whatever norm_topk_prob says
        per_token = raw["mova_num_experts_per_tok"]
        out["value_expert_keys"] = {"num_experts": raw["mova_num_experts"], "num_experts_per_tok": per_token,
                                    "norm_topk_prob": isinstance(per_token, int) and per_token > 1}
    return out


def _k2_horizon_layers(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Experts on the layers neither in mlp_only_layers nor off decoder_sparse_step, where num_experts > 0."""
    only, step = set(raw.get("mlp_only_layers") or ()), raw.get("decoder_sparse_step") or 1
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise Refusal(f"invalid model config: decoder_sparse_step is {step!r}; state a positive integer")
    routes = bool(raw.get("num_experts"))
    return (("attention",) * num_layers,
            tuple("moe" if routes and i not in only and (i + 1) % step == 0 else "dense" for i in range(num_layers)))


def _k2_rules() -> tuple[Rule, ...]:
    mlp, attn, values = "model.layers.{i}.mlp", "model.layers.{i}.self_attn", "layers.{i}.attn.value_experts."
    return (_LLAMA + expert_rules(mlp) + shared_rules(f"{mlp}.shared_experts")
            + (Rule(f"{attn}.gate_proj.weight", "layers.{i}.attn.gate.weight"),
               Rule(f"{mlp}.gate.weight", "layers.{i}.mlp.router.weight"),
               # the gate's bias moves the scores only to choose: a selection bias, not a logit bias
               Rule(f"{mlp}.gate.bias", ROUTER_CORRECTION),
               Rule(f"{attn}.v_router.weight", f"{values}router"),
               Rule(f"{attn}.v_router.bias", f"{values}correction"),
               Rule(f"{attn}.v_experts.{{e}}.weight", f"{values}experts")))


REMOTE_VARIANTS_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("step1", _LLAMA, positions=PositionSpec(kind="alibi", alibi_sqrt=True), normalize=_step1,
               parity_reference=_REFERENCE),
    # a layer without attention keeps its feed-forward's norm, post_attention_layernorm, as the block's only one
    FamilySpec("nemotron-nas", _LLAMA + (Rule("model.layers.{i}.post_attention_layernorm.weight",
                                              "layers.{i}.attn_norm.weight"),),
               normalize=_nemotron_nas, layer_kinds=_nemotron_nas_layers, parity_reference=_REFERENCE),
    FamilySpec("k2_horizon", _k2_rules(), positions=PositionSpec(theta=1_000_000.0), normalize=_k2_horizon,
               layer_kinds=_k2_horizon_layers,
               moe=MoESpec(scoring="sigmoid", scaling="always", shared="deepseek"), parity_reference=_REFERENCE),
)
