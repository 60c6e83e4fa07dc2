"""Mistral's own checkpoint format (params.json beside consolidated*.safetensors): dense name maps.

The tensors are Transformers' mistral ones under Mistral's names (tok_embeddings, layers.{i}.attention.wq,
feed_forward.w1 = gate, w3 = up, w2 = down, ffn_norm, norm, output). Their query and key rows keep
Mistral's native order, each head's rotation pairs adjacent, where Transformers' conversion script
permutes them into halves; so, as vLLM does, this spec rotates adjacent pairs and loads every tensor
as stored: no tensor is permuted on the way in, and a rank reads its heads' rows as they lie.

Adapters name Transformers' modules (q_proj, ...) in Transformers' row order: they are placed through
the family's Transformers spec, and their query and key B rows put in pair order (`pair_rows`).
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules
from ster_dist.families.spec import AttentionSpec, FamilySpec, PositionSpec

_MISTRAL_NAMES = llama_rules(
    root="", attn="attention", q="wq", k="wk", v="wv", o="wo",
    mlp="feed_forward", gate="w1", up="w3", down="w2",
    attn_norm="attention_norm", mlp_norm="ffn_norm", q_norm=None, k_norm=None,
    final_norm="norm", embed="tok_embeddings", head="output",
)

MISTRAL_FORMAT_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("mistral", _MISTRAL_NAMES, attention=AttentionSpec(sliding="all"),
               positions=PositionSpec(interleaved=True), weight_format="mistral", pair_rows=("attn.q", "attn.k")),
)
