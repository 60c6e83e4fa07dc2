"""Further dense families on the shared decoder (EXAONE 3, Apertus, Jais 2, HyperCLOVA X, IQuest-Coder, Granite SWA).

EXAONE 3 and IQuest-Coder have no modeling code of their own in Transformers: it runs them as Llama
(LlamaForCausalLM, EXAONE's names renamed on load), which is their parity reference.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.spec import FamilySpec, Rule

_LLAMA = llama_rules(q_norm=None, k_norm=None)


def _exaone_rules() -> tuple[Rule, ...]:
    """Llama's block below transformer.h (EXAONE 3 and 3.5's own names)."""
    h = "transformer.h.{i}."
    rules = [Rule("transformer.wte.weight", "embed.weight"), *weight_and_bias("lm_head", "lm_head"),
             *weight_and_bias("transformer.ln_f", "final_norm"),
             *weight_and_bias(f"{h}ln_1", "layers.{i}.attn_norm"), *weight_and_bias(f"{h}ln_2", "layers.{i}.mlp_norm")]
    for name, target in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
        rules += weight_and_bias(f"{h}attn.attention.{name}", f"layers.{{i}}.attn.{target}")
    for name, target in (("c_fc_0", "gate"), ("c_fc_1", "up"), ("c_proj", "down")):
        rules += weight_and_bias(f"{h}mlp.{name}", f"layers.{{i}}.mlp.{target}")
    return tuple(rules)


# what Transformers' config classes assume where a config is silent
_EXAONE_DEFAULTS = {"num_key_value_heads": 8, "layer_norm_epsilon": 1e-5, "eos_token_id": 361, "pad_token_id": 0}
_IQUESTCODER_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 8, "rms_norm_eps": 1e-5}
_APERTUS_DEFAULTS = {"hidden_act": "xielu", "rms_norm_eps": 1e-5, "max_position_embeddings": 65536, "pad_token_id": 3,
                     "rope_parameters": {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                                         "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0}}
# xIELU's stored numbers, each layer's own
_XIELU = tuple(Rule(f"model.layers.{{i}}.mlp.act_fn.{name}", f"layers.{{i}}.mlp.act.{name}")
               for name in ("alpha_p", "alpha_n", "beta", "eps"))
_GRANITE_SWA_DEFAULTS = {"num_key_value_heads": 4, "rms_norm_eps": 1e-5, "sliding_window": 128,
                         "sliding_window_pattern": 4}

DENSE_EXTRA_FAMILIES: tuple[FamilySpec, ...] = (
    # EXAONE 3 / 3.5: Llama under its own names (num_layers, layer_norm_epsilon, activation_function)
    FamilySpec("exaone", _exaone_rules(), default_rope_theta=500_000.0, config_defaults=_EXAONE_DEFAULTS,
               parity_reference="LlamaForCausalLM"),
    # IQuest-Coder: Llama with mlp_bias, clip_qkv and Qwen2's max_window_layers sliding window (the last two are
    # refused by Transformers' config class, so parity covers the biases only)
    FamilySpec("iquestcoder", _LLAMA, sliding="max_window_layers", config_defaults=_IQUESTCODER_DEFAULTS,
               parity_reference="LlamaForCausalLM"),
    # HyperCLOVA X: Granite with a norm over each sublayer's output (use_post_norm) and logits_scaling multiplying
    FamilySpec("hyperclovax", llama_rules(post_attn_norm="post_norm1", post_mlp_norm="post_norm2", q_norm=None,
                                          k_norm=None),
               post_norm_key="use_post_norm", logits_scaling_multiplies=True,
               config_defaults={"use_post_norm": True}, parity_reference="HyperCLOVAXForCausalLM"),
    # Granite SWA: Granite with a learned sink per head, sliding layers (all but the first of each four when
    # layer_types is unstated) and layer_rope_theta (zero: the layer does not rotate)
    FamilySpec("granite_swa", _LLAMA + (Rule("model.layers.{i}.self_attn.sinks", "layers.{i}.attn.sinks.weight"),),
               attn_sinks=True, sliding="pattern_first", tied_default=True, config_defaults=_GRANITE_SWA_DEFAULTS,
               parity_reference="GraniteSWAForCausalLM"),
    # Apertus: per-head query/key norms, norms named for their sublayers, a plain xIELU feed-forward without biases
    FamilySpec("apertus", llama_rules(gate=None, attn_norm="attention_layernorm", mlp_norm="feedforward_layernorm")
               + _XIELU, qk_norm="head", mlp_gated=False, mlp_bias_keys=(), default_rope_theta=12_000_000.0,
               config_defaults=_APERTUS_DEFAULTS, parity_reference="ApertusForCausalLM"),
    # Jais 2: Arcee's plain squared-ReLU feed-forward under biased LayerNorms; biases on by default
    FamilySpec("jais2", llama_rules(gate=None, q_norm=None, k_norm=None), norm_kind="layer", norm_bias=True,
               mlp_gated=False, qkv_bias_default=True, o_bias_default=True, mlp_bias_default=True,
               config_defaults={"hidden_act": "relu2", "layer_norm_eps": 1e-5}, parity_reference="Jais2ForCausalLM"),
)
