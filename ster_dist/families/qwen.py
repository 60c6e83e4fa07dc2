"""Qwen's dense and sparse families, and Mellum, which Transformers builds from Qwen3-MoE.

- qwen2: Llama with biased query/key/value and a sliding window above max_window_layers.
- qwen3: Qwen2 without the biases, with per-head query/key norms.
- qwen2_moe: Qwen2 over routed experts plus one shared expert scaled by its own sigmoid gate.
- qwen3_moe: Qwen3's attention over routed experts, no shared expert.
- mellum: Qwen3-MoE whose layer kinds (layer_types, mlp_layer_types) and per-kind rope_parameters the shared
  config reading already covers; its multi-token-prediction tensors are ignored.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules, shared_rules
from ster_dist.families.spec import FamilySpec, MoESpec, Rule

_MLP = "model.layers.{i}.mlp"
_LLAMA = llama_rules(q_norm=None, k_norm=None)
_QWEN3_MOE = llama_rules() + expert_rules(_MLP) + router_rules(f"{_MLP}.gate")

QWEN_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("qwen2", _LLAMA, sliding="max_window_layers", qkv_bias_keys=(), qkv_bias_default=True,
               o_bias_keys=(), mlp_bias_keys=(), parity_reference="Qwen2ForCausalLM"),
    FamilySpec("qwen3", llama_rules(), sliding="max_window_layers", qk_norm="head", o_bias_keys=(),
               mlp_bias_keys=(), parity_reference="Qwen3ForCausalLM"),
    FamilySpec("qwen2_moe", _LLAMA + expert_rules(_MLP) + router_rules(f"{_MLP}.gate")
               + shared_rules(f"{_MLP}.shared_expert")
               + (Rule(f"{_MLP}.shared_expert_gate.weight", "layers.{i}.mlp.shared_gate.weight"),),
               sliding="max_window_layers", qkv_bias_keys=("qkv_bias",), qkv_bias_default=True, o_bias_keys=(),
               mlp_bias_keys=(), moe=MoESpec(shared="qwen"), parity_reference="Qwen2MoeForCausalLM"),
    FamilySpec("qwen3_moe", _QWEN3_MOE, sliding="max_window_layers", qk_norm="head", mlp_bias_keys=(),
               moe=MoESpec(), parity_reference="Qwen3MoeForCausalLM"),
    FamilySpec("mellum", _QWEN3_MOE, qk_norm="head", mlp_bias_keys=(), ignore=(r"mtp\..*",), moe=MoESpec(),
               parity_reference="MellumForCausalLM"),
)
