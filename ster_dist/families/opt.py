"""Meta's OPT, a lineage of its own: names below model.decoder, learned positions read two rows in, a plain
fc1 / fc2 feed-forward, enable_bias on every projection, LayerNorms at Transformers' fixed epsilon, and a
projection of the embedding width (word_embed_proj_dim). Its post-norm and norm-less variants are refused.
"""

from __future__ import annotations

from ster_dist.families.layouts import weight_and_bias
from ster_dist.families.spec import FamilySpec, Rule
from ster_dist.families.switches import BIASED_LAYER_NORM_PLAIN_MLP


def _opt_rules() -> tuple[Rule, ...]:
    d, layer = "model.decoder.", "model.decoder.layers.{i}."
    return (
        Rule(f"{d}embed_tokens.weight", "embed.weight"), Rule(f"{d}embed_positions.weight", "pos_embed.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        *(rule for src, dst in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o"))
          for rule in weight_and_bias(f"{layer}self_attn.{src}", f"layers.{{i}}.attn.{dst}")),
        *weight_and_bias(f"{layer}self_attn_layer_norm", "layers.{i}.attn_norm"),
        *weight_and_bias(f"{layer}final_layer_norm", "layers.{i}.mlp_norm"),
        *weight_and_bias(f"{layer}fc1", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{layer}fc2", "layers.{i}.mlp.down"),
        *weight_and_bias(f"{d}final_layer_norm", "final_norm"),
    )


_ENABLE_BIAS = dict(qkv_bias_keys=("enable_bias",), qkv_bias_default=True, o_bias_keys=("enable_bias",),
                    o_bias_default=True, mlp_bias_keys=("enable_bias",), mlp_bias_default=True)

OPT_FAMILIES: tuple[FamilySpec, ...] = (
    # learned positions read two rows in, enable_bias on every projection, LayerNorms at Transformers' epsilon
    FamilySpec("opt", _opt_rules(), optional_prefix="model.", **BIASED_LAYER_NORM_PLAIN_MLP, norm_eps=1e-5,
               positions="learned", position_offset=2, tied_default=True, **_ENABLE_BIAS,
               width_keys=("word_embed_proj_dim",), config_defaults={"activation_function": "relu"},
               require_values={
                   "do_layer_norm_before": (True, "OPT's post-norm blocks are not supported"),
                   "_remove_final_layer_norm": (False, "OPT without its final norm is not supported"),
                   "layer_norm_elementwise_affine": (True, "OPT's norms without scale and bias are not supported")},
               parity_reference="OPTForCausalLM"),
)
