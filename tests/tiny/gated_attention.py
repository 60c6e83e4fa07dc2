"""Tiny checkpoints of ster_dist/families/gated_attention.py's families."""

from __future__ import annotations

from tests.tiny_tokenizer import TINY_VOCAB_SIZE

TINY: dict[str, tuple[str, str, dict]] = {
    # sliding (rotated) layers around an unrotated full-attention one, a window shorter than the
    # prompts, a dense
    # first layer, sigmoid routing with expert_bias, two shared experts, route_scale, mup's
    # embedding scale
    "afmoe": (
        "AfmoeConfig",
        "AfmoeForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_shared_experts=2,
            route_scale=1.7,
            global_attn_every_n_layers=2,
            sliding_window=5,
            mup_enabled=True,
        ),
    ),
}

# Muse Glimmer's image-text wrapper (Transformers has no text-only head): the text decoder below
# model.language_model, the head at the root, beside a one-block vision tower. Four layers: three
# sliding and
# rotated, the last fully attending and unrotated; a window shorter than the prompts; the output
# norms at an
# epsilon far from the others' so that it shows; a query multiplier under sqrt(head_dim); a logit
# multiplier
# and soft cap
_MUSE_TEXT = dict(
    vocab_size=TINY_VOCAB_SIZE + 1,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=5,
    qk_scale_factor=3.0,
    output_multiplier=0.7,
    final_logit_softcapping=5.0,
    post_norm_eps=1e-3,
    rms_norm_eps=1e-6,
)
TINY["muse_glimmer"] = (
    "MuseGlimmerConfig",
    "MuseGlimmerForConditionalGeneration",
    dict(
        text_config=_MUSE_TEXT,
        out_hidden_size=16,
        projector_hidden_size=16,
        vision_config=dict(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            patch_size=2,
            pos_emb_height=4,
            pos_emb_width=4,
        ),
    ),
)
VARIANT_FAMILY = {"muse_glimmer": "muse_glimmer_text"}
UNSTATED_BASE = {
    "muse_glimmer": (
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
