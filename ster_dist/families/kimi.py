"""Kimi-Linear: Kimi delta attention beside DeepSeek's latent attention, over DeepSeek-V3's experts.

- kimi_linear: the layers linear_attn_config.kda_layers names (counted from one) run Kimi delta
  attention (model/kimi_delta.py, its tensors under self_attn: q/k/v_proj, q/k/v_conv1d,
  f_a/f_b_proj, A_log, dt_bias, b_proj, g_a/g_b_proj, o_norm, o_proj); the rest run latent attention
  (model/mla.py), unrotated when mla_use_nope holds. After first_k_dense_replace dense layers the
  feed-forward is block_sparse_moe: experts {e}.w1/w3/w2, a sigmoid router
  (moe_router_activation_func) with e_score_correction_bias, grouped top-k under use_grouped_topk,
  renormalised under moe_renormalize, scaled by routed_scaling_factor, beside shared_experts. The
  checkpoint's q_proj and o_proj names are latent attention's in attention layers and the delta
  attention's in the others: shard/plan.py picks the rule whose parameter the layer has. Kimi-K3's
  switches (kimi_k3 wraps this decoder) are refused until they are built.
- bailing_hybrid (Ling 3.0): layer_types (by default the last layer of every layer_group_size a
  latent attention layer, the rest Kimi delta attention), all under `attention` as Ling publishes
  them (word_embeddings, dense as the output projection, q/k/v_conv1d; Transformers fuses the three
  convolutions only in memory). Its delta attention has full-rank f_proj and g_proj and the bounded
  decay under kda_safe_gate; its latent attention gates each head by sigmoid(g_proj(x)). After
  first_k_dense_replace dense layers (or as mlp_layer_types says), DeepSeek-V3's experts whose
  selection bias is gate.expert_bias, under Ling's names for the routing keys.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.deepseek import DEEPSEEK_V3_ROUTER, latent_rules
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import (
    ROUTER_CORRECTION,
    expert_rules,
    router_rules,
    shared_rules,
)
from ster_dist.families.spec import AttentionSpec, FamilySpec, PositionSpec, Rule

_ATTN, _MIXER = "model.layers.{i}.self_attn", "layers.{i}.mixer"
_MOE = "model.layers.{i}.block_sparse_moe"
# Kimi-K3's switches, not built here
_K3_SWITCHES = ("mla_use_output_gate", "routed_expert_hidden_size", "attn_res_block_size")


def _delta_rules() -> tuple[Rule, ...]:
    names = (
        ("q_proj.weight", "q.weight"),
        ("k_proj.weight", "k.weight"),
        ("v_proj.weight", "v.weight"),
        ("q_conv1d.weight", "q_conv"),
        ("k_conv1d.weight", "k_conv"),
        ("v_conv1d.weight", "v_conv"),
        ("f_a_proj.weight", "f_a.weight"),
        ("f_b_proj.weight", "f_b.weight"),
        ("A_log", "A_log"),
        ("dt_bias", "dt_bias"),
        ("b_proj.weight", "b.weight"),
        ("g_a_proj.weight", "g_a.weight"),
        ("g_b_proj.weight", "g_b.weight"),
        ("o_norm.weight", "norm_weight"),
        ("o_proj.weight", "out.weight"),
    )
    return tuple(Rule(f"{_ATTN}.{name}", f"{_MIXER}.{target}") for name, target in names)


# the dense layers' feed-forward is `mlp` in Moonshot's checkpoints and `block_sparse_moe` as
# Transformers saves it
_RULES = (
    llama_rules(q=None, k=None, v=None, q_norm=None, k_norm=None)
    + latent_rules()
    + _delta_rules()
    + tuple(
        Rule(
            f"model.layers.{{i}}.block_sparse_moe.{name}_proj.weight",
            f"layers.{{i}}.mlp.{name}.weight",
        )
        for name in ("gate", "up", "down")
    )
    + expert_rules(_MOE, "w1", "w3", "w2")
    + router_rules(f"{_MOE}.gate")
    + shared_rules(f"{_MOE}.shared_experts")
)


# linear_attn_config's sizes and the names Transformers reads them under (model/kimi_delta.py reads
# these)
_SIZES = (
    ("num_heads", "linear_num_heads"),
    ("head_dim", "linear_head_dim"),
    ("short_conv_kernel_size", "linear_conv_kernel_dim"),
)


def _linear_config(raw: dict) -> dict:
    linear = raw.get("linear_attn_config")
    if not isinstance(linear, dict):
        raise Refusal(
            f"invalid model config: linear_attn_config is {linear!r}; Kimi-Linear needs it, with "
            "kda_layers, num_heads, head_dim and short_conv_kernel_size"
        )
    for key, _ in _SIZES:
        value = linear.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise Refusal(
                f"invalid model config: linear_attn_config.{key} is {value!r}; Kimi delta attention "
                "needs it as a positive integer"
            )
    return linear


def _kda_layers(raw: dict, num_layers: int) -> set[int]:
    """The delta attention's layers, counted from zero."""
    layers = _linear_config(raw).get("kda_layers")
    if not isinstance(layers, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= num_layers for i in layers
    ):
        raise Refusal(
            f"invalid model config: linear_attn_config.kda_layers is {layers!r}; it must list layers "
            f"counted from one, each within the {num_layers} layers"
        )
    return {i - 1 for i in layers}


def _normalize(raw: dict) -> dict:
    """Kimi's spellings under the names the shared reader knows, the layer types kda_layers states,
    and every attention layer unrotated under mla_use_nope."""
    out = dict(raw, mlp_bias=False)  # no feed-forward bias, whatever mlp_bias says
    for key in _K3_SWITCHES + ("use_full_rank_gate",):
        if out.get(key) or (out.get("linear_attn_config") or {}).get(key):
            raise Refusal(
                f"invalid model config: {key} is set; Kimi-K3's {key} is not supported for kimi_linear "
                "(its layers would be read wrongly); use a Kimi-Linear checkpoint without it"
            )
    if not out.get("kv_lora_rank"):
        raise Refusal(
            "invalid model config: kv_lora_rank is not stated; Kimi-Linear's latent attention layers "
            "need it"
        )
    linear = _linear_config(out)
    for key, name in _SIZES:
        out[name] = linear[key]
    layers = out.get("num_hidden_layers")
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
        kda = _kda_layers(out, layers)
        out["layer_types"] = [
            "linear_attention" if i in kda else "full_attention" for i in range(layers)
        ]
        if out.get("mla_use_nope"):
            out["no_rope_layers"] = [0] * layers
    activation = out.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise Refusal(
            f"invalid model config: moe_router_activation_func is {activation!r}; Kimi-Linear's router "
            "is supported with sigmoid scores only"
        )
    out["scoring_func"] = "sigmoid"
    for kimi, generic in (
        ("num_experts_per_token", "num_experts_per_tok"),
        ("moe_renormalize", "norm_topk_prob"),
        ("num_shared_experts", "n_shared_experts"),
        ("model_max_length", "max_position_embeddings"),
    ):
        if out.get(kimi) is not None:
            out[generic] = out[kimi]
    if out.get("use_grouped_topk", True) and out.get("num_expert_group") is not None:
        out["n_group"] = out["num_expert_group"]
    elif not out.get("use_grouped_topk", True):
        out["n_group"], out["topk_group"] = 1, 1
    return out


def _layer_kinds(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    kda = _kda_layers(raw, num_layers)
    mixers = tuple("kimi_delta" if i in kda else "latent_attention" for i in range(num_layers))
    sparse = raw.get("mlp_layer_types")
    if sparse is None:
        first_dense = int(raw.get("first_k_dense_replace", 1))  # Transformers' default
        sparse = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    experts = int(raw.get("num_experts") or 0)
    return mixers, tuple("moe" if experts and kind == "sparse" else "dense" for kind in sparse)


KIMI_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "kimi_linear",
        _RULES,
        attention=AttentionSpec(latent=True),
        positions=PositionSpec(interleaved=True),
        moe=DEEPSEEK_V3_ROUTER,
        parity_reference="KimiLinearForCausalLM",
        normalize=_normalize,
        layer_kinds=_layer_kinds,
    ),
)


# Ling 3.0
# ------------------------------------------------------------------------------------------------------

_LING_ATTN, _LING_MLP = "model.layers.{i}.attention", "model.layers.{i}.mlp"


def _ling_rules() -> tuple[Rule, ...]:
    delta = (
        ("q_proj.weight", "q.weight"),
        ("k_proj.weight", "k.weight"),
        ("v_proj.weight", "v.weight"),
        ("q_conv1d.weight", "q_conv"),
        ("k_conv1d.weight", "k_conv"),
        ("v_conv1d.weight", "v_conv"),
        ("f_proj.weight", "f.weight"),
        ("A_log", "A_log"),
        ("dt_bias", "dt_bias"),
        ("b_proj.weight", "b.weight"),
        ("g_proj.weight", "g.weight"),
        ("o_norm.weight", "norm_weight"),
        ("dense.weight", "out.weight"),
    )
    # q_proj, g_proj and dense name both kinds' tensors: shard/plan.py picks the rule whose
    # parameter the layer has
    return (
        llama_rules(
            attn="attention",
            q=None,
            k=None,
            v=None,
            o="dense",
            q_norm=None,
            k_norm=None,
            embed="word_embeddings",
        )
        + latent_rules(_LING_ATTN)
        + (Rule(f"{_LING_ATTN}.g_proj.weight", "layers.{i}.attn.head_gate.weight"),)
        + tuple(Rule(f"{_LING_ATTN}.{name}", f"{_MIXER}.{target}") for name, target in delta)
        + expert_rules(_LING_MLP)
        + router_rules(f"{_LING_MLP}.gate")
        + (Rule(f"{_LING_MLP}.gate.expert_bias", ROUTER_CORRECTION),)
        + shared_rules(f"{_LING_MLP}.shared_experts")
    )


# BailingHybridConfig's Ling names -> the generic ones, and its defaults
_LING_NAMES = (
    ("num_experts_per_token", "num_experts_per_tok"),
    ("moe_renormalize", "norm_topk_prob"),
    ("num_shared_experts", "n_shared_experts"),
    ("num_expert_group", "n_group"),
    ("model_max_length", "max_position_embeddings"),
)
_LING_DEFAULTS = {
    "num_experts": 512,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 2,
    "rms_norm_eps": 1e-6,
    "layer_group_size": 6,
    "short_conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "rope_theta": 6_000_000.0,
    "moe_intermediate_size": 768,
}


def _ling_layer_types(raw: dict, layers: int) -> list[str]:
    stated = raw.get("layer_types")
    if stated is None:
        group = raw["layer_group_size"]
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise Refusal(
                f"invalid model config: layer_group_size is {group!r}; it must be a positive integer"
            )
        stated = [
            "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(layers)
        ]
    if (
        not isinstance(stated, list)
        or len(stated) != layers
        or not set(stated) <= {"full_attention", "linear_attention"}
    ):
        raise Refusal(
            f'invalid model config: layer_types must list "full_attention" or "linear_attention" '
            f"for each of the {layers} layers"
        )
    return stated


def _normalize_ling(raw: dict) -> dict:
    out = dict(raw, mlp_bias=False, scoring_func="sigmoid")
    for ling, generic in _LING_NAMES:
        if out.get(ling) is not None:
            out[generic] = out[ling]
    for key, value in _LING_DEFAULTS.items():
        if out.get(key) is None:
            out[key] = value
    if not out.get("kv_lora_rank"):
        raise Refusal(
            "invalid model config: kv_lora_rank is not stated; Ling 3.0's latent attention layers need it"
        )
    # the delta attention's sizes: Transformers keeps the delta head width as linear_head_dim once
    # it has
    # turned head_dim into the latent heads' rotated width; Ling's own configs state it as head_dim
    out["linear_num_heads"] = out.get("linear_num_heads") or out.get("num_attention_heads")
    out["linear_head_dim"] = out.get("linear_head_dim") or out.get("head_dim")
    out["linear_conv_kernel_dim"] = (
        out.get("linear_conv_kernel_dim") or out["short_conv_kernel_size"]
    )
    out["kda_full_rank_gates"] = True
    out["mla_head_gate"] = True
    layers = out.get("num_hidden_layers")
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
        out["layer_types"] = _ling_layer_types(out, layers)
    return out


def _ling_layer_kinds(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    mixers = tuple(
        "latent_attention" if kind == "full_attention" else "kimi_delta"
        for kind in _ling_layer_types(raw, num_layers)
    )
    sparse = raw.get("mlp_layer_types")
    if sparse is None:
        first_dense = int(raw["first_k_dense_replace"])
        sparse = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    if len(sparse) != num_layers or not set(sparse) <= {"dense", "sparse"}:
        raise Refusal(
            f'invalid model config: mlp_layer_types must list "dense" or "sparse" for each of the '
            f"{num_layers} layers"
        )
    experts = int(raw.get("num_experts") or 0)
    return mixers, tuple("moe" if experts and kind == "sparse" else "dense" for kind in sparse)


KIMI_FAMILIES += (
    FamilySpec(
        "bailing_hybrid",
        _ling_rules(),
        attention=AttentionSpec(latent=True),
        positions=PositionSpec(interleaved=True),
        moe=DEEPSEEK_V3_ROUTER,
        parity_reference="BailingHybridForCausalLM",
        normalize=_normalize_ling,
        layer_kinds=_ling_layer_kinds,
    ),
)
