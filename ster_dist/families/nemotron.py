"""Nemotron and the families Transformers builds from its feed-forward: Llama's attention over a plain
down(act(up(x))) with no gate.

- nemotron: LayerNorm1P (a biased LayerNorm whose scale is stored as an offset from one), squared ReLU, half of
  each head rotated.
- arcee: Nemotron's squared-ReLU feed-forward under Llama's RMS norms.
- jais2: Arcee's feed-forward under biased LayerNorms, every projection biased by default.
- apertus: an xIELU feed-forward (four stored numbers per layer) without biases, per-head query/key norms, norms
  named for their sublayers.

InternLM3 has no spec: the installed Transformers ships only its config class, so there is no reference to check
parity against.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.normalize import defaults, stated, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    FeedForwardSpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)

# a plain feed-forward: down(act(up(x))), squared ReLU unless the config says otherwise
_PLAIN = llama_rules(gate=None, q_norm=None, k_norm=None)
_UNGATED = FeedForwardSpec(gated=False)
# what Transformers' config classes assume where a config is silent
_APERTUS_DEFAULTS = {"hidden_act": "xielu", "rms_norm_eps": 1e-5, "max_position_embeddings": 65536, "pad_token_id": 3,
                     "rope_parameters": {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                                         "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0}}
# xIELU's stored numbers, each layer's own
_XIELU = tuple(Rule(f"model.layers.{{i}}.mlp.act_fn.{name}", f"layers.{{i}}.mlp.act.{name}")
               for name in ("alpha_p", "alpha_n", "beta", "eps"))


def _jais2(raw: dict) -> dict:
    """Every projection biased unless attention_bias / mlp_bias say not."""
    raw = with_defaults(raw, {"hidden_act": "relu2", "layer_norm_eps": 1e-5})
    return {**raw, "attention_bias": bool(stated(raw, "attention_bias", default=True)),
            "mlp_bias": bool(stated(raw, "mlp_bias", default=True))}


NEMOTRON_FAMILIES: tuple[FamilySpec, ...] = (
    # LayerNorm1P: a biased LayerNorm whose scale is stored as an offset from one; half of each head rotates
    FamilySpec("nemotron", _PLAIN, norms=NormSpec(kind="layer", bias=True, offset=1.0), feed_forward=_UNGATED,
               positions=PositionSpec(rotary_share=0.5), normalize=defaults({"hidden_act": "relu2", "norm_eps": 1e-5}),
               parity_reference="NemotronForCausalLM"),
    FamilySpec("arcee", _PLAIN, feed_forward=_UNGATED,
               normalize=defaults({"hidden_act": "relu2", "rms_norm_eps": 1e-5}),
               parity_reference="ArceeForCausalLM"),
    # Jais 2: Arcee's plain squared-ReLU feed-forward under biased LayerNorms; biases on by default
    FamilySpec("jais2", _PLAIN, norms=NormSpec(kind="layer", bias=True), feed_forward=_UNGATED, normalize=_jais2,
               parity_reference="Jais2ForCausalLM"),
    # Apertus: per-head query/key norms, norms named for their sublayers, a plain xIELU feed-forward without biases
    FamilySpec("apertus", llama_rules(gate=None, attn_norm="attention_layernorm", mlp_norm="feedforward_layernorm")
               + _XIELU, attention=AttentionSpec(qk_norm=QKNormSpec("head")), feed_forward=_UNGATED,
               positions=PositionSpec(theta=12_000_000.0), normalize=defaults(_APERTUS_DEFAULTS),
               parity_reference="ApertusForCausalLM"),
)
