"""openPangu-Embedded, published as remote code on the Hub (no Transformers class), as data (openPangu-Ultra-MoE,
a latent-attention mixture, is with the other remote mixtures in moe_remote.py).

- PanguEmbedded: Llama with biased attention projections (qkv_bias for query, key and value), mlp_bias, and
  under sandwich_norm a norm over each sublayer's output beside pre_mlp_layernorm before the feed-forward.

ster_dist never runs its remote code: it is checked against the reference written in
tests/test_telechat_mimo_pangu_nanbeige.py from seeds/000's description (Transformers' Llama on renamed weights
without sandwich_norm, a plain-torch forward with it).
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.normalize import biases, stated, switch
from ster_dist.families.spec import FamilySpec

# openPangu-Embedded: under sandwich_norm post_attention_layernorm is the norm over attention's output and
# pre_mlp_layernorm the feed-forward's input norm; without it post_attention_layernorm is that input norm.
# The matcher gives a name two rules match to the one whose parameter the model has.
_PANGU = (llama_rules(q_norm=None, k_norm=None, mlp_norm=None, post_attn_norm="post_attention_layernorm",
                     post_mlp_norm="post_mlp_layernorm")
          + weight_and_bias("model.layers.{i}.pre_mlp_layernorm", "layers.{i}.mlp_norm")
          + weight_and_bias("model.layers.{i}.post_attention_layernorm", "layers.{i}.mlp_norm"))


def _pangu(raw: dict) -> dict:
    """Every attention projection biased (query, key and value as qkv_bias says, when it does); sandwich_norm
    as the generic post-norm switch."""
    qkv = bool(stated(raw, "qkv_bias", default=True))
    return {**biases(raw, qkv, out=True, mlp=switch(raw, "mlp_bias")), "use_post_norm": switch(raw, "sandwich_norm")}


PANGU_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("PanguEmbedded", _PANGU, normalize=_pangu,
               parity_reference="tests/test_telechat_mimo_pangu_nanbeige.py"),
)
