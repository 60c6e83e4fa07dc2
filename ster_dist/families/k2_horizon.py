"""K2-Horizon, as data.

- k2_horizon (K2-Horizon, IFM's, published as remote code): Llama's block whose hidden-width RMS
  norms normalise layernorm_num_groups equal groups apart (norm_groups), every attention projection
  biased under attention_bias, and under attention_gate_func attention's output times silu or log2(1
  + 2^g) of self_attn.gate_proj (output_gate_func). The layers neither in mlp_only_layers nor off
  decoder_sparse_step route over num_experts experts by router_score_func scores, which
  mlp.gate.bias moves only to choose under moe_gate_bias (noaux_tc over one group), renormalised
  under norm_topk_prob and scaled by router_scaling_factor, beside num_shared_experts shared ones.
  Under mova_num_experts those layers' values come from value experts (value_expert_keys:
  model/value_experts.py), routed by self_attn.v_router the same way except that their weights are
  renormalised whenever mova_num_experts_per_tok > 1 (as K2-Horizon's own code does); they have no
  v_proj, so no value adapter has a place there. Unstated keys take K2HorizonConfig's defaults
  (num_experts 0: a dense model).

ster_dist never runs its remote code: it is checked against the reference written in
tests/families/test_step1_nemotron_nas_k2_horizon.py from seeds/000's description.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import ROUTER_CORRECTION, expert_rules, shared_rules
from ster_dist.families.normalize import ConfigProblem, with_defaults
from ster_dist.families.spec import FamilySpec, MoESpec, PositionSpec, Rule

_LLAMA = llama_rules(q_norm=None, k_norm=None)


# what K2HorizonConfig (IFM's configuration class) assumes where a config is silent
_K2_DEFAULTS = {
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "use_sliding_window": False,
    "layernorm_num_groups": 1,
    "query_key_norm": False,
    "attention_gate_func": None,
    "num_experts": 0,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
    "moe_gate_bias": False,
    "num_shared_experts": 0,
    "router_score_func": "softmax",
    "mova_num_experts": 0,
    "mova_num_experts_per_tok": 0,
    "tie_word_embeddings": False,
}
# its rotation where a config states neither rope_parameters nor rope_scaling (the base is
# PositionSpec.theta)
_K2_ROPE = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 8192,
    "attention_factor": 1.2772588722239782,
    "beta_fast": 128.0,
    "beta_slow": 4.0,
    "truncate": True,
}
_K2_GATES = {None: "none", "silu": "silu", "softplus": "softplus_ln2"}


def _k2_horizon(raw: dict) -> dict:
    """K2-Horizon's keys as the generic ones; its router as noaux_tc over one group when the gate's
    bias chooses."""
    raw = with_defaults(raw, _K2_DEFAULTS)
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        raw = {**raw, "rope_parameters": {**_K2_ROPE, "rope_theta": 1_000_000.0}}
    if raw.get("use_sliding_window"):
        raise ConfigProblem(
            "use_sliding_window is set: K2-Horizon's sliding window is not supported; use a config "
            "with it false"
        )
    if raw.get("query_key_norm"):
        raise ConfigProblem(
            "query_key_norm is set: K2-Horizon's grouped query/key norms are not supported; use a "
            "config with it false"
        )
    rope, head = raw.get("rope_head_dim"), raw.get("head_dim")
    if rope is not None and rope != head:
        raise ConfigProblem(
            f"rope_head_dim {rope} is narrower than head_dim {head}: a partial rotation of "
            "K2-Horizon's layout is not supported; use a config rotating the whole head"
        )
    gate = raw.get("attention_gate_func")
    if gate not in _K2_GATES:
        raise ConfigProblem(
            f"attention_gate_func {gate!r} is not supported; supported: silu, softplus, null"
        )
    chooses = bool(raw.get("moe_gate_bias"))
    scaling = raw.get("router_scaling_factor")
    # the class drops a stated window unless use_sliding_window
    out = {
        **raw,
        "sliding_window": None,
        "norm_groups": raw["layernorm_num_groups"],
        "output_gate_func": _K2_GATES[gate],
        "mlp_bias": False,
        "scoring_func": raw["router_score_func"],
        "topk_method": "noaux_tc" if chooses else "greedy",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0 if scaling is None else scaling,
        "n_shared_experts": raw["num_shared_experts"],
    }
    if raw.get("mova_num_experts"):
        # the value router renormalises whenever it chooses more than one expert, whatever
        # norm_topk_prob says
        per_token = raw["mova_num_experts_per_tok"]
        out["value_expert_keys"] = {
            "num_experts": raw["mova_num_experts"],
            "num_experts_per_tok": per_token,
            "norm_topk_prob": isinstance(per_token, int) and per_token > 1,
        }
    return out


def _k2_horizon_layers(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Experts on the layers neither in mlp_only_layers nor off decoder_sparse_step, where
    num_experts > 0."""
    only, step = set(raw.get("mlp_only_layers") or ()), raw.get("decoder_sparse_step") or 1
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise Refusal(
            f"invalid model config: decoder_sparse_step is {step!r}; state a positive integer"
        )
    routes = bool(raw.get("num_experts"))
    return (
        ("attention",) * num_layers,
        tuple(
            "moe" if routes and i not in only and (i + 1) % step == 0 else "dense"
            for i in range(num_layers)
        ),
    )


def _k2_rules() -> tuple[Rule, ...]:
    mlp, attn, values = (
        "model.layers.{i}.mlp",
        "model.layers.{i}.self_attn",
        "layers.{i}.attn.value_experts.",
    )
    return (
        _LLAMA
        + expert_rules(mlp)
        + shared_rules(f"{mlp}.shared_experts")
        + (
            Rule(f"{attn}.gate_proj.weight", "layers.{i}.attn.gate.weight"),
            Rule(f"{mlp}.gate.weight", "layers.{i}.mlp.router.weight"),
            # the gate's bias moves the scores only to choose: a selection bias, not a logit bias
            Rule(f"{mlp}.gate.bias", ROUTER_CORRECTION),
            Rule(f"{attn}.v_router.weight", f"{values}router"),
            Rule(f"{attn}.v_router.bias", f"{values}correction"),
            Rule(f"{attn}.v_experts.{{e}}.weight", f"{values}experts"),
        )
    )


K2_HORIZON_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "k2_horizon",
        _k2_rules(),
        positions=PositionSpec(theta=1_000_000.0),
        normalize=_k2_horizon,
        layer_kinds=_k2_horizon_layers,
        moe=MoESpec(scoring="sigmoid", scaling="always", shared="deepseek"),
        parity_reference="tests/families/test_step1_nemotron_nas_k2_horizon.py",
    ),
)
