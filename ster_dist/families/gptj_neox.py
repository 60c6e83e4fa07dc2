"""EleutherAI's rotary decoders and StableLM, which grew from GPT-NeoX: LayerNorms, a plain
feed-forward, a parallel residual, part of each head rotated.

- gptj: one norm before a parallel block, unbiased attention, adjacent pairs rotating over
  rotary_dim, a biased head, names below transformer.h.
- gpt_neox: a parallel block with a norm per branch (use_parallel_residual, sequential when off),
  one query_key_value tensor grouped head by head, a quarter of each head rotated unless stated.
- stablelm: Llama's names under LayerNorms, GPT-NeoX's use_parallel_residual and quarter rotation,
  optional per-head LayerNorm query/key norms stored one tensor per head.
"""

from __future__ import annotations

from ster_dist.families.gpt2 import (
    BIASED_LAYER_NORMS,
    LAYER_NORM_EPSILON_DEFAULT,
    PLAIN_FEED_FORWARD,
)
from ster_dist.families.layouts import fused_qkv, llama_rules, weight_and_bias
from ster_dist.families.normalize import biases, stated, switch, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)


def _gptj_rules() -> tuple[Rule, ...]:
    h = "transformer.h.{i}."
    return (
        Rule("transformer.wte.weight", "embed.weight"),
        *weight_and_bias("lm_head", "lm_head"),
        *weight_and_bias(f"{h}ln_1", "layers.{i}.attn_norm"),
        *(
            Rule(f"{h}attn.{src}.weight", f"layers.{{i}}.attn.{dst}.weight")
            for src, dst in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o"))
        ),
        *weight_and_bias(f"{h}mlp.fc_in", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{h}mlp.fc_out", "layers.{i}.mlp.down"),
        *weight_and_bias("transformer.ln_f", "final_norm"),
    )


def _gpt_neox_rules() -> tuple[Rule, ...]:
    layer = "gpt_neox.layers.{i}."
    return (
        Rule("gpt_neox.embed_in.weight", "embed.weight"),
        Rule("embed_out.weight", "lm_head.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        *weight_and_bias(f"{layer}input_layernorm", "layers.{i}.attn_norm"),
        *weight_and_bias(f"{layer}post_attention_layernorm", "layers.{i}.mlp_norm"),
        *fused_qkv(
            f"{layer}attention.query_key_value", groups="heads", q_count="one", kv_count="one"
        ),
        *weight_and_bias(f"{layer}attention.dense", "layers.{i}.attn.o"),
        *weight_and_bias(f"{layer}mlp.dense_h_to_4h", "layers.{i}.mlp.up"),
        *weight_and_bias(f"{layer}mlp.dense_4h_to_h", "layers.{i}.mlp.down"),
        *weight_and_bias("gpt_neox.final_layer_norm", "final_norm"),
    )


def _stablelm_rules() -> tuple[Rule, ...]:
    per_head = tuple(
        Rule(
            f"model.layers.{{i}}.self_attn.{src}_layernorm.norms.{{h}}.weight",
            f"layers.{{i}}.attn.{src}_norm.weight",
        )
        for src in ("q", "k")
    )
    return llama_rules(q_norm=None, k_norm=None) + per_head


def _gptj(raw: dict) -> dict:
    """Unbiased attention, a biased feed-forward and head, whatever the config says."""
    raw = with_defaults(raw, {**LAYER_NORM_EPSILON_DEFAULT, "activation_function": "gelu_new"})
    return {**biases(raw, False, mlp=True), "lm_head_bias": True}


def _gpt_neox(raw: dict) -> dict:
    """The attention biased unless attention_bias says not, the feed-forward always; parallel unless
    use_parallel_residual says not."""
    raw = with_defaults(raw, {"use_parallel_residual": True})
    return biases(raw, bool(stated(raw, "attention_bias", default=True)), mlp=True)


def _stablelm(raw: dict) -> dict:
    """use_qkv_bias biases query/key/value only; the query/key LayerNorms only under
    qk_layernorm."""
    return {
        **biases(raw, switch(raw, "use_qkv_bias"), out=False),
        "use_qk_norm": switch(raw, "qk_layernorm"),
    }


# a quarter of each head rotated unless stated
_QUARTER = PositionSpec(rotary_share=0.25)

GPTJ_NEOX_FAMILIES: tuple[FamilySpec, ...] = (
    # one norm before a parallel block, unbiased attention, adjacent pairs rotating over rotary_dim,
    # biased head
    FamilySpec(
        "gptj",
        _gptj_rules(),
        optional_prefix="transformer.",
        ignore=(r".*\.attn\.(masked_)?bias$", r"transformer\.bias$"),
        norms=NormSpec(kind="layer", bias=True, parallel=True),
        feed_forward=PLAIN_FEED_FORWARD,
        positions=PositionSpec(interleaved=True),
        normalize=_gptj,
        parity_reference="GPTJForCausalLM",
    ),
    # a norm per branch of the parallel block
    FamilySpec(
        "gpt_neox",
        _gpt_neox_rules(),
        ignore=(r".*\.attention\.(masked_)?bias$",),
        norms=NormSpec(kind="layer", bias=True, parallel_shared=False),
        feed_forward=PLAIN_FEED_FORWARD,
        positions=_QUARTER,
        normalize=_gpt_neox,
        parity_reference="GPTNeoXForCausalLM",
    ),
    FamilySpec(
        "stablelm",
        _stablelm_rules(),
        norms=BIASED_LAYER_NORMS,
        attention=AttentionSpec(qk_norm=QKNormSpec("head", kind="layer", per_head_weight=True)),
        positions=_QUARTER,
        normalize=_stablelm,
        parity_reference="StableLmForCausalLM",
    ),
)
