"""Qwen's dense and sparse families, and Mellum, which Transformers builds from Qwen3-MoE.

- qwen2: Llama with biased query/key/value and a sliding window above max_window_layers.
- qwen3: Qwen2 without the biases, with per-head query/key norms.
- qwen2_moe: Qwen2 over routed experts plus one shared expert scaled by its own sigmoid gate.
- qwen3_moe: Qwen3's attention over routed experts, no shared expert.
- mellum: Qwen3-MoE whose layer kinds (layer_types, mlp_layer_types) and per-kind rope_parameters
  the shared config reading already covers; its multi-token-prediction tensors are ignored.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules, shared_rules
from ster_dist.families.normalize import biases, stated
from ster_dist.families.spec import AttentionSpec, FamilySpec, MoESpec, QKNormSpec, Rule

_MLP = "model.layers.{i}.mlp"
_LLAMA = llama_rules(q_norm=None, k_norm=None)
_QWEN3_MOE = llama_rules() + expert_rules(_MLP) + router_rules(f"{_MLP}.gate")
_MAX_WINDOW_LAYERS = AttentionSpec(sliding="max_window_layers")
_QWEN3_ATTENTION = AttentionSpec(sliding="max_window_layers", qk_norm=QKNormSpec("head"))


def _qwen2_moe(raw: dict) -> dict:
    """Query/key/value biased unless qkv_bias says not; the output and the feed-forward never."""
    return biases(raw, bool(stated(raw, "qkv_bias", default=True)), out=False)


QWEN_FAMILIES: tuple[FamilySpec, ...] = (
    # query/key/value always biased, the output and the feed-forward never
    FamilySpec(
        "qwen2",
        _LLAMA,
        attention=_MAX_WINDOW_LAYERS,
        normalize=lambda raw: biases(raw, True, out=False),
        parity_reference="Qwen2ForCausalLM",
    ),
    # attention_bias biases query/key/value only
    FamilySpec(
        "qwen3",
        llama_rules(),
        attention=_QWEN3_ATTENTION,
        normalize=lambda raw: {**raw, "attention_out_bias": False},
        parity_reference="Qwen3ForCausalLM",
    ),
    FamilySpec(
        "qwen2_moe",
        _LLAMA
        + expert_rules(_MLP)
        + router_rules(f"{_MLP}.gate")
        + shared_rules(f"{_MLP}.shared_expert")
        + (Rule(f"{_MLP}.shared_expert_gate.weight", "layers.{i}.mlp.shared_gate.weight"),),
        attention=_MAX_WINDOW_LAYERS,
        normalize=_qwen2_moe,
        moe=MoESpec(shared="qwen"),
        parity_reference="Qwen2MoeForCausalLM",
    ),
    FamilySpec(
        "qwen3_moe",
        _QWEN3_MOE,
        attention=_QWEN3_ATTENTION,
        moe=MoESpec(),
        parity_reference="Qwen3MoeForCausalLM",
    ),
    FamilySpec(
        "mellum",
        _QWEN3_MOE,
        attention=AttentionSpec(qk_norm=QKNormSpec("head")),
        ignore=(r"mtp\..*",),
        moe=MoESpec(),
        parity_reference="MellumForCausalLM",
    ),
)
