"""Meta's OPT, a lineage of its own: names below model.decoder, learned positions read two rows in,
a plain fc1 / fc2 feed-forward, enable_bias on every projection, LayerNorms at Transformers' fixed
epsilon, and a projection of the embedding width (word_embed_proj_dim). Its post-norm and norm-less
variants are refused.
"""

from __future__ import annotations

from ster_dist.families.gpt2 import PLAIN_FEED_FORWARD
from ster_dist.families.layouts import weight_and_bias
from ster_dist.families.normalize import biases_from, with_defaults
from ster_dist.families.spec import EmbeddingSpec, FamilySpec, NormSpec, PositionSpec, Rule


def _opt_rules() -> tuple[Rule, ...]:
    d, layer = "model.decoder.", "model.decoder.layers.{i}."
    return (
        Rule(f"{d}embed_tokens.weight", "embed.weight"),
        Rule(f"{d}embed_positions.weight", "pos_embed.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        *(
            rule
            for src, dst in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o"))
            for rule in weight_and_bias(f"{layer}self_attn.{src}", f"layers.{{i}}.attn.{dst}")
        ),
        *weight_and_bias(f"{layer}self_attn_layer_norm", "layers.{i}.attn_norm"),
        *weight_and_bias(f"{layer}final_layer_norm", "layers.{i}.mlp_norm"),
        *weight_and_bias(f"{layer}fc1", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{layer}fc2", "layers.{i}.mlp.down"),
        *weight_and_bias(f"{d}final_layer_norm", "final_norm"),
    )


OPT_FAMILIES: tuple[FamilySpec, ...] = (
    # learned positions read two rows in, enable_bias (on unless stated off) on every projection,
    # LayerNorms at
    # Transformers' epsilon; word_embed_proj_dim must be the model width
    FamilySpec(
        "opt",
        _opt_rules(),
        optional_prefix="model.",
        norms=NormSpec(kind="layer", bias=True, eps=1e-5),
        feed_forward=PLAIN_FEED_FORWARD,
        positions=PositionSpec(kind="learned", offset=2),
        embedding=EmbeddingSpec(tied=True),
        normalize=lambda raw: biases_from(
            with_defaults(raw, {"activation_function": "relu"}), "enable_bias", default=True
        ),
        require_values={
            "do_layer_norm_before": (True, "OPT's post-norm blocks are not supported"),
            "_remove_final_layer_norm": (False, "OPT without its final norm is not supported"),
            "layer_norm_elementwise_affine": (
                True,
                "OPT's norms without scale and bias are not supported",
            ),
        },
        parity_reference="OPTForCausalLM",
    ),
)
