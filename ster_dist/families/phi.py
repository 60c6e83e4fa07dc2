"""Microsoft's Phi dense families (PhiMoE follows Mixtral's classes and lives in mixtral.py).

- phi (Phi-1/2): a parallel block under one biased LayerNorm, a plain feed-forward, every projection
  and the head biased, optional per-head LayerNorm query/key norms, half of each head rotated unless
  stated.
- phi3: Llama's block with fused qkv_proj and gate_up_proj tensors, a sliding window on every layer,
  no biases.
"""

from __future__ import annotations

from ster_dist.families.layouts import fused_gate_up, fused_qkv, llama_rules
from ster_dist.families.normalize import always_biased, never_biased, switch
from ster_dist.families.spec import (
    AttentionSpec,
    FamilySpec,
    FeedForwardSpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
)


def _phi(raw: dict) -> dict:
    """Every projection and the head biased; the query/key LayerNorms only under qk_layernorm."""
    return {**always_biased(raw), "lm_head_bias": True, "use_qk_norm": switch(raw, "qk_layernorm")}


PHI_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "phi",
        llama_rules(
            o="dense",
            gate=None,
            up="fc1",
            down="fc2",
            mlp_norm=None,
            final_norm="final_layernorm",
            q_norm="q_layernorm",
            k_norm="k_layernorm",
        ),
        norms=NormSpec(kind="layer", bias=True, parallel=True),
        feed_forward=FeedForwardSpec(gated=False),
        attention=AttentionSpec(qk_norm=QKNormSpec("head", kind="layer", bias=True)),
        positions=PositionSpec(rotary_share=0.5),
        normalize=_phi,
        parity_reference="PhiForCausalLM",
    ),
    FamilySpec(
        "phi3",
        llama_rules(q=None, k=None, v=None, gate=None, up=None, q_norm=None, k_norm=None)
        + fused_qkv("model.layers.{i}.self_attn.qkv_proj")
        + fused_gate_up("model.layers.{i}.mlp.gate_up_proj"),
        attention=AttentionSpec(sliding="all"),
        normalize=never_biased,
        parity_reference="Phi3ForCausalLM",
    ),
)
