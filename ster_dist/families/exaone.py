"""LG's EXAONE families.

- exaone (EXAONE 3 / 3.5): Llama's block under its own names below transformer.h (num_layers,
  layer_norm_epsilon, activation_function); Transformers has no model class of its own and runs it
  as LlamaForCausalLM, renaming on load, which is its parity reference.
- exaone4: OLMo 2's post-norm block with per-head query/key norms; with a sliding window, only the
  sliding layers rotate.
- exaone_moe: EXAONE 4's attention in a pre-norm block over DeepSeek-V3's router and shared experts.
"""

from __future__ import annotations

from ster_dist.families.deepseek import DEEPSEEK_V3_ROUTER
from ster_dist.families.layouts import OLMO2_POST_NORMS, llama_rules, weight_and_bias
from ster_dist.families.moe_layouts import ROUTER_CORRECTION, deepseek_moe_rules
from ster_dist.families.normalize import defaults, never_biased, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)


def _exaone_rules() -> tuple[Rule, ...]:
    """Llama's block below transformer.h (EXAONE 3 and 3.5's own names)."""
    h = "transformer.h.{i}."
    rules = [
        Rule("transformer.wte.weight", "embed.weight"),
        *weight_and_bias("lm_head", "lm_head"),
        *weight_and_bias("transformer.ln_f", "final_norm"),
        *weight_and_bias(f"{h}ln_1", "layers.{i}.attn_norm"),
        *weight_and_bias(f"{h}ln_2", "layers.{i}.mlp_norm"),
    ]
    for name, target in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
        rules += weight_and_bias(f"{h}attn.attention.{name}", f"layers.{{i}}.attn.{target}")
    for name, target in (("c_fc_0", "gate"), ("c_fc_1", "up"), ("c_proj", "down")):
        rules += weight_and_bias(f"{h}mlp.{name}", f"layers.{{i}}.mlp.{target}")
    return tuple(rules)


# what Transformers' config classes assume where a config is silent
_EXAONE_DEFAULTS = {
    "num_key_value_heads": 8,
    "layer_norm_epsilon": 1e-5,
    "eos_token_id": 361,
    "pad_token_id": 0,
}
_SLIDING_EVERY_FOURTH_FULL = {"sliding_window": 4096, "sliding_window_pattern": 4}

# EXAONE 4's attention: per-head query/key norms, sliding layers by pattern and only they rotate
_EXAONE4_ATTENTION = AttentionSpec(qk_norm=QKNormSpec("head"), sliding="pattern")
_SLIDING_ROTATE = PositionSpec(layers="sliding")
_EXAONE_MOE_DEFAULTS = {
    **_SLIDING_EVERY_FOURTH_FULL,
    "first_k_dense_replace": 1,
    "num_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}

EXAONE_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "exaone",
        _exaone_rules(),
        positions=PositionSpec(theta=500_000.0),
        normalize=defaults(_EXAONE_DEFAULTS),
        parity_reference="LlamaForCausalLM",
    ),
    # no projection biased, whatever the config says
    FamilySpec(
        "exaone4",
        llama_rules(**OLMO2_POST_NORMS),
        norms=NormSpec(pre=False, post=True),
        attention=_EXAONE4_ATTENTION,
        positions=_SLIDING_ROTATE,
        normalize=lambda raw: never_biased(with_defaults(raw, _SLIDING_EVERY_FOURTH_FULL)),
        parity_reference="Exaone4ForCausalLM",
    ),
    FamilySpec(
        "exaone_moe",
        llama_rules()
        + deepseek_moe_rules()
        + (Rule("model.layers.{i}.mlp.e_score_correction_bias", ROUTER_CORRECTION),),
        attention=_EXAONE4_ATTENTION,
        positions=_SLIDING_ROTATE,
        ignore=(r"mtp\..*",),
        normalize=lambda raw: never_biased(with_defaults(raw, _EXAONE_MOE_DEFAULTS)),
        moe=DEEPSEEK_V3_ROUTER,
        parity_reference="ExaoneMoeForCausalLM",
    ),
)
