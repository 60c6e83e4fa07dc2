"""The one table between llama.cpp's GGUF tensor names and Transformers' names.

Keyed by the file's `general.architecture`. Each family lists its per-block
names, whether llama.cpp permuted q/k rows when it converted the model, and
the shape every tensor must have, written in config symbols, so the source can
check a file against config.json before reading any data. Both directions
(GGUF -> Transformers for listing, Transformers -> GGUF for reads) are derived
from this table; nothing else spells a GGUF name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# Shape symbols, resolved from config.json by `symbols()`.
HIDDEN, VOCAB, INTER, Q_DIM, KV_DIM, HEAD_DIM = (
    "hidden",
    "vocab",
    "inter",
    "q_dim",
    "kv_dim",
    "head_dim",
)

# GGUF base name -> (Transformers module, weight shape [out, in] or [n]).
# A `.bias` of any entry has the weight's first dimension.
GLOBAL: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "token_embd": ("model.embed_tokens", (VOCAB, HIDDEN)),
    "output_norm": ("model.norm", (HIDDEN,)),
    "output": ("lm_head", (VOCAB, HIDDEN)),
}

LLAMA_BLOCK: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "attn_q": ("self_attn.q_proj", (Q_DIM, HIDDEN)),
    "attn_k": ("self_attn.k_proj", (KV_DIM, HIDDEN)),
    "attn_v": ("self_attn.v_proj", (KV_DIM, HIDDEN)),
    "attn_output": ("self_attn.o_proj", (HIDDEN, Q_DIM)),
    "ffn_gate": ("mlp.gate_proj", (INTER, HIDDEN)),
    "ffn_up": ("mlp.up_proj", (INTER, HIDDEN)),
    "ffn_down": ("mlp.down_proj", (HIDDEN, INTER)),
    "attn_norm": ("input_layernorm", (HIDDEN,)),
    "ffn_norm": ("post_attention_layernorm", (HIDDEN,)),
}

QK_NORM_BLOCK: Mapping[str, tuple[str, tuple[str, ...]]] = {
    **LLAMA_BLOCK,
    "attn_q_norm": ("self_attn.q_norm", (HEAD_DIM,)),
    "attn_k_norm": ("self_attn.k_norm", (HEAD_DIM,)),
}


@dataclass(frozen=True)
class GGUFFamily:
    arch: str  # general.architecture in the file
    model_type: str  # Transformers model_type the importer writes
    architecture: str  # Transformers class for config.json "architectures"
    block: Mapping[str, tuple[str, tuple[str, ...]]]
    # llama.cpp's convert_hf_to_gguf permutes q/k rows (and biases) of LlamaModel
    # (Mistral included, it converts as "llama") to its interleaved rotary layout;
    # Qwen2/Qwen3 keep Transformers' half-split layout.
    permute_qk: bool


FAMILIES: Mapping[str, GGUFFamily] = {
    f.arch: f
    for f in (
        GGUFFamily("llama", "llama", "LlamaForCausalLM", LLAMA_BLOCK, permute_qk=True),
        GGUFFamily("qwen2", "qwen2", "Qwen2ForCausalLM", LLAMA_BLOCK, permute_qk=False),
        GGUFFamily("qwen3", "qwen3", "Qwen3ForCausalLM", QK_NORM_BLOCK, permute_qk=False),
    )
}

# Tensors llama.cpp derives from the config at conversion time; they have no
# Transformers parameter, and their meaning is not in the metadata (llama3 rope
# scaling is baked into rope_freqs), so a file holding one is refused, not guessed.
DERIVED = {"rope_freqs.weight": "llama3-style rope scaling baked into the file"}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")
_HF_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class Mapped:
    """One tensor under both names, with its layer and GGUF base name (e.g. attn_q)."""

    gguf: str
    hf: str
    base: str
    layer: int | None
    kind: str  # "weight" | "bias"
    shape: tuple[str, ...]  # symbolic, Transformers orientation


def to_hf(family: GGUFFamily, gguf_name: str) -> Mapped | None:
    """The Transformers side of a GGUF name; None when the table has no rule for it."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, base, kind = int(m[1]), m[2], m[3]
        if base not in family.block:
            return None
        module, shape = family.block[base]
        return Mapped(
            gguf_name,
            f"model.layers.{layer}.{module}.{kind}",
            base,
            layer,
            kind,
            shape if kind == "weight" else shape[:1],
        )
    if m := _GLOBAL_RE.match(gguf_name):
        base, kind = m[1], m[2]
        if base not in GLOBAL:
            return None
        module, shape = GLOBAL[base]
        return Mapped(
            gguf_name,
            f"{module}.{kind}",
            base,
            None,
            kind,
            shape if kind == "weight" else shape[:1],
        )
    return None


def to_gguf(family: GGUFFamily, hf_name: str) -> str | None:
    """The GGUF name a Transformers name is stored under; None when no rule covers it."""
    if m := _HF_BLOCK_RE.match(hf_name):
        for base, (module, _) in family.block.items():
            if module == m[2]:
                return f"blk.{m[1]}.{base}.{m[3]}"
        return None
    for base, (module, _) in GLOBAL.items():
        if hf_name in (f"{module}.weight", f"{module}.bias"):
            return f"{base}.{hf_name.rsplit('.', 1)[1]}"
    return None


def symbols(config: dict) -> dict[str, int | None]:
    """Shape symbols from a Transformers config dict (head_dim defaults to hidden / heads)."""
    hidden = config.get("hidden_size")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    return {
        HIDDEN: hidden,
        VOCAB: config.get("vocab_size"),
        INTER: config.get("intermediate_size"),
        HEAD_DIM: head_dim,
        Q_DIM: heads * head_dim if heads and head_dim else None,
        KV_DIM: kv_heads * head_dim if kv_heads and head_dim else None,
    }
