"""Tiny checkpoints of ster_dist/families/hyper.py's families."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_tokenizer import TINY_VOCAB_SIZE

TINY: dict[str, tuple[str, str, dict]] = {
    # three streams; fewer indexer keys (index_topk) than the parity prompts' 40 tokens; the middle
    # layer reuses
    # the first's choice; a small swiglu_limit so the experts' clamp bites; a dense first layer
    "hy_v4": (
        "HYV4Config",
        "HYV4ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            routed_scaling_factor=1.5,
            index_topk=12,
            index_n_heads=8,
            index_head_dim=16,
            indexer_types=["full", "shared", "full"],
            hc_mult=3,
            hc_magnitude=1.5,
            swiglu_limit=0.1,
            initializer_range=0.02,
        ),
    ),
}

# GLM-5-Next's image-text wrapper (Transformers has no text-only head): the text decoder below
# model.language_model
# beside a one-block vision tower. Delta attention, then latent attention behind the pooled indexer,
# twice; pools
# of four and index_topk 8 (two pools a query) against the parity prompts' 40 tokens so the choice
# bites, sixteen
# indexer heads (so no two pools tie at a zero score); two delta heads (one per tensor-parallel
# rank); three
# streams; a dense first layer, grouped experts; a small swiglu_limit so every clamp bites
_GLM5_TEXT = dict(
    vocab_size=TINY_VOCAB_SIZE + 1,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=0,
    qk_nope_head_dim=12,
    v_head_dim=10,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    n_group=2,
    topk_group=1,
    index_topk=8,
    index_n_heads=16,
    index_head_dim=16,
    index_kpool=4,
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    swiglu_limit=0.5,
    hc_mult=3,
    linear_attn_config=dict(num_heads=2, head_dim=12, short_conv_kernel_size=4),
)
TINY["glm5_next"] = (
    "Glm5NextConfig",
    "Glm5NextForConditionalGeneration",
    dict(
        text_config=_GLM5_TEXT,
        vision_config=dict(
            depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=48
        ),
    ),
)
VARIANT_FAMILY = {"glm5_next": "glm5_next_text"}
UNSTATED_BASE = {
    "glm5_next": (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
    )
}


def _halves_order(rows: int) -> torch.Tensor:
    """Rows of a rotated slice in pair order (channels 2i, 2i+1 side by side) put by halves: evens,
    then odds."""
    return torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2)))


def _tail_by_halves(t: torch.Tensor, groups: int, rope: int) -> torch.Tensor:
    """`t`'s rows in `groups` equal groups, the last `rope` rows of each put from pair order into
    halves order."""
    grouped = t.reshape(groups, -1, *t.shape[1:])
    return torch.cat(
        (grouped[:, :-rope], grouped[:, -rope:][:, _halves_order(rope)]), dim=1
    ).reshape(t.shape)


def _rotated_rows_by_halves(
    directory: Path, per_head: str, heads_key: str, once: tuple[str, ...]
) -> None:
    """Rewrite the checkpoint's tensors named `...per_head` (the last qk_rope_head_dim rows of each
    of config[heads_key] heads) and `...once` (their last ones) from pair order into halves
    order."""
    config = json.loads((directory / "config.json").read_text())
    rope, heads = config["qk_rope_head_dim"], config[heads_key]
    for file in directory.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith(per_head):
                tensors[name] = _tail_by_halves(t, heads, rope)
            elif name.endswith(once):
                tensors[name] = _tail_by_halves(t, 1, rope)
        save_file(tensors, file, metadata={"format": "pt"})


def as_rotated_by_halves(directory: Path) -> None:
    """Rewrite a HY V4 checkpoint's rotated rows of latent attention (each head's last
    qk_rope_head_dim of q_b_proj, the last ones of kv_a_proj_with_mqa) from the release's pair order
    (Megatron's layout, which vLLM and Transformers since 5.25 rotate by adjacent pairs) to halves
    order, the layout a reader rotating halves would need."""
    _rotated_rows_by_halves(
        directory,
        "self_attn.q_b_proj.weight",
        "num_attention_heads",
        ("self_attn.kv_a_proj_with_mqa.weight",),
    )


def _as_hy_v4_release(directory: Path) -> None:
    """The indexer as HY V4 publishes it: Transformers 5.25 rotates the indexer's tail by adjacent
    pairs too, where the release's readers (vLLM, SGLang's HY V4 port, Transformers up to 5.24:
    "split-half RoPE") rotate it by halves, so its rows (wq_b per head, wk and k_norm once) go from
    pair order into halves order, which rotated by halves equal Transformers' pairs rotating on its
    own."""
    _rotated_rows_by_halves(
        directory,
        "indexer.wq_b.weight",
        "index_n_heads",
        ("indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias"),
    )


SAVED_AS = {"hy_v4": _as_hy_v4_release}
