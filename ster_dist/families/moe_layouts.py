"""Name maps of mixture-of-experts layers shared by several lineages (data, built by small
functions).

Decoder parameter names of an MoE layer: layers.{i}.mlp.router.{weight,bias,correction},
layers.{i}.mlp.experts.{gate,up,down}[_bias] (stacked [experts, ...]),
layers.{i}.mlp.shared.{gate,up,down}.weight and layers.{i}.mlp.shared_gate.weight.

Experts are read from published per-expert tensors (experts.{e}.w1/w3/w2,
experts.{e}.gate_proj/up_proj/down_proj) and from stacked ones: Transformers 5's
own experts.gate_up_proj [experts, 2 * inner, hidden] and down_proj; the layouts
only one lineage stores (GraniteMoE's input_linear / output_linear, DBRX's flat
w1 / v1 / w2, GPT-OSS's inputs-first interleaved gate_up_proj) live with it.
"""

from __future__ import annotations

from ster_dist.families.spec import Rule, Stacked

EXPERTS = "layers.{i}.mlp.experts."
ROUTER_CORRECTION = "layers.{i}.mlp.router.correction"


def expert_rules(
    prefix: str,
    gate: str = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    stacked: str | None = None,
) -> tuple[Rule, ...]:
    """Per-expert tensors under `prefix`.experts.{e}, and Transformers 5's stacked layout under
    `stacked`."""
    rules = tuple(
        Rule(f"{prefix}.experts.{{e}}.{name}.weight", f"{EXPERTS}{target}")
        for name, target in ((gate, "gate"), (up, "up"), (down, "down"))
    )
    where = stacked or prefix
    return rules + (
        Rule(f"{where}.experts.gate_up_proj", Stacked((f"{EXPERTS}gate", f"{EXPERTS}up"))),
        Rule(f"{where}.experts.down_proj", Stacked((f"{EXPERTS}down",))),
    )


def shared_rules(prefix: str) -> tuple[Rule, ...]:
    return tuple(
        Rule(f"{prefix}.{name}.weight", f"layers.{{i}}.mlp.shared.{target}.weight")
        for name, target in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
    )


def router_rules(checkpoint: str) -> tuple[Rule, ...]:
    return (
        Rule(f"{checkpoint}.weight", "layers.{i}.mlp.router.weight"),
        Rule(f"{checkpoint}.bias", "layers.{i}.mlp.router.bias"),
        Rule(f"{checkpoint}.e_score_correction_bias", ROUTER_CORRECTION),
    )


def deepseek_moe_rules(mlp: str = "model.layers.{i}.mlp") -> tuple[Rule, ...]:
    """DeepSeek's sparse layer names (experts, gate, shared_experts), which GLM-4-MoE, EXAONE MoE,
    Cohere 2 MoE and Sarvam MoE keep."""
    return expert_rules(mlp) + router_rules(f"{mlp}.gate") + shared_rules(f"{mlp}.shared_experts")
