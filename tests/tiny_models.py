"""Tiny random checkpoints of every Transformers-implemented family, built at test time.

TINY gathers tests/tiny/<lineage>.py, one module per ster_dist/families/<lineage>.py. Each entry:
(Transformers config class name, model class name, config kwargs over BASE_CONFIG). Sizes are small
and odd where the family allows: key-value heads below heads, head_dim unlike hidden/heads, vocab
not divisible by two, tied and untied heads, rope scaling variants; mixture-of-experts checkpoints
have 6-8 experts, top-2, so expert-parallel ranks get uneven loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny import (
    bloom_falcon,
    cohere,
    deepseek,
    deepseek_v4,
    ernie,
    exaone,
    falcon_h1,
    gated_attention,
    gemma,
    gemma3n,
    gemma4,
    glm,
    gpt2,
    gptj_neox,
    granite,
    hunyuan,
    hyper,
    inkling,
    kimi,
    laguna,
    lfm2,
    llama,
    llama4,
    longcat,
    looped,
    mamba,
    mamba2,
    mimo,
    minimax,
    minimax_m3,
    mixtral,
    mpt,
    nemotron,
    olmo,
    opt,
    phi,
    qwen,
    qwen3_next,
    sparse_attention,
    zamba2,
)
from tests.tiny_tokenizer import TINY_VOCAB_SIZE

# odd, and one row more than the tokenizer uses, as real checkpoints often have
VOCAB = TINY_VOCAB_SIZE + 1
BASE_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# named as ster_dist/families/ names them (tests/families/test_parity.py checks each holds its
# module's families)
LINEAGES = {
    module.__name__.rsplit(".", 1)[1]: module
    for module in (
        llama,
        nemotron,
        gemma,
        qwen,
        mixtral,
        deepseek,
        phi,
        olmo,
        glm,
        cohere,
        granite,
        exaone,
        ernie,
        hunyuan,
        gpt2,
        gptj_neox,
        bloom_falcon,
        mpt,
        opt,
        lfm2,
        mamba,
        mamba2,
        qwen3_next,
        kimi,
        zamba2,
        minimax,
        falcon_h1,
        llama4,
        mimo,
        laguna,
        gated_attention,
        inkling,
        longcat,
        gemma3n,
        hyper,
        looped,
        sparse_attention,
        minimax_m3,
        gemma4,
        deepseek_v4,
    )
}
TINY: dict[str, tuple[str, str, dict]] = {
    v: entry for m in LINEAGES.values() for v, entry in m.TINY.items()
}
assert len(TINY) == sum(len(m.TINY) for m in LINEAGES.values()), "a tiny variant is named twice"
# VARIANT_FAMILY and UNSTATED_BASE are optional in a lineage's module: most need neither
_VARIANT_FAMILY = {
    v: f for m in LINEAGES.values() for v, f in getattr(m, "VARIANT_FAMILY", {}).items()
}
_UNSTATED_BASE = {
    v: keys for m in LINEAGES.values() for v, keys in getattr(m, "UNSTATED_BASE", {}).items()
}
# a variant saved as its family's own release rather than as Transformers saves it: a rewrite of the
# directory
_SAVED_AS = {
    v: rewrite for m in LINEAGES.values() for v, rewrite in getattr(m, "SAVED_AS", {}).items()
}


def family_of_variant(variant: str) -> str:
    return _VARIANT_FAMILY.get(variant, variant)


def unstated_base(variant: str) -> tuple[str, ...]:
    """Keys of BASE_CONFIG the variant's config class does not take (it states those sizes under its
    own names)."""
    return _UNSTATED_BASE.get(variant, ())


def tiny_config(variant: str, change: dict | None = None):
    """The Transformers config of a tiny `variant`, its kwargs updated by `change`
    (tests/shape_sweep.py's one-key variations)."""
    import transformers

    config_cls, _, kwargs = TINY[variant]
    base = {k: v for k, v in BASE_CONFIG.items() if k not in unstated_base(variant)}
    config = getattr(transformers, config_cls)(**{**base, **kwargs, **(change or {})})
    # Transformers 5.2x's DBRX attention reads attn_config.rope_theta, which its config lacks
    if config_cls == "DbrxConfig":
        config.attn_config.rope_theta = 10000.0
    return config


def make_tiny(variant: str, directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Save a tiny random checkpoint (safetensors + config.json + a tokenizer) and return the
    Transformers model."""
    import transformers

    config = tiny_config(variant)
    torch.manual_seed(seed)
    model = getattr(transformers, TINY[variant][1])(config).to(dtype).eval()
    perturb_norms(model, seed)
    _perturb_experts(model, variant, seed)
    model.save_pretrained(directory, safe_serialization=True)
    if variant in _SAVED_AS:
        _SAVED_AS[variant](Path(directory))
    from tests.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(Path(directory))
    return model


def load_tiny(variant: str, tmp_path_factory) -> tuple[Path, object, object]:
    """(directory, Transformers model, our model in f32) of a tiny `variant` saved in a fresh
    temporary directory: what a module-scoped fixture of one family's tests returns."""
    from ster_dist.load import load_model
    from ster_dist.resolve import resolve

    directory = tmp_path_factory.mktemp(variant)
    reference = make_tiny(variant, directory)
    return directory, reference, load_model(resolve(str(directory)), "f32").model


def random_ids(length: int, seed: int = 0) -> torch.Tensor:
    """Two rows of `length` token ids the tiny tokenizer's vocabulary holds, past its special
    tokens."""
    return torch.randint(3, 300, (2, length), generator=torch.Generator().manual_seed(seed))


# Gemma 2's and VaultGemma's config change (for with_config) that makes their soft cap of attention
# scores matter:
# a tiny random model's scores lie far below the cap of 5, where capping changes nothing; queries
# scaled by 45
# (query_pre_attn_scalar 0.01 for 20) bring them to it (the eager logits then move 2% with the cap)
SCORES_AT_THE_CAP = {"query_pre_attn_scalar": 0.01}


def with_config(directory: Path, target: Path, change: dict, text: bool = False) -> Path:
    """A copy of the checkpoint at `directory` in `target`, its config's keys (its text_config's,
    with `text`, for an image-text wrapper) updated by `change`."""
    import shutil

    shutil.copytree(directory, target)
    path = Path(target) / "config.json"
    config = json.loads(path.read_text())
    if text:
        config["text_config"] = {**config["text_config"], **change}
    else:
        config.update(change)
    path.write_text(json.dumps(config, indent=2))
    return Path(target)


def perturb_norms(model, seed: int) -> None:
    """Random inits leave norm scales at one and biases at zero; perturb them so parity tests see
    them."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.1)


def _perturb_experts(model, variant: str, seed: int) -> None:
    """Random inits leave DeepSeek-V3's and LFM2-MoE's selection biases and GPT-OSS's expert biases
    at zero; set them. In one layer, steer the router away from the upper half of the experts, so
    that under two expert-parallel ranks the second receives no token there."""
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, t in list(model.named_buffers()) + list(model.named_parameters()):
            if variant == "axk1" and name.endswith("e_score_correction_bias"):
                continue  # A.X-K1 routes without a selection bias: its releases store none
            if name.endswith(("e_score_correction_bias", "feed_forward.expert_bias")) or (
                ".experts." in name and name.endswith("_bias")
            ):
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.05)
            # AFMoE's class starts its router at zero
            if name.endswith("router.gate.weight") and not t.any():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.2)
            # DeepSeek-V4's hash table starts at zero: each token its own experts
            if name.endswith("tid2eid"):
                experts = model.config.num_local_experts
                t.copy_(
                    torch.stack(
                        [
                            torch.randperm(experts, generator=gen)[: t.shape[1]]
                            for _ in range(t.shape[0])
                        ]
                    )
                )
            # DeepSeek-V4's compressors start without a position bias
            if name.endswith("position_bias"):
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.5)
            if name.endswith("layer_scalar"):  # Gemma 4's stored scalar per layer starts at one
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.3)
        # an image-text wrapper: its text decoder's
        last = model.config.get_text_config().num_hidden_layers - 1
        for name, t in list(model.named_buffers()) + list(model.named_parameters()):
            if f"layers.{last}." not in name:
                continue
            if variant in (
                "deepseek_v3",
                "glm4_moe_lite",
                "ernie4_5_moe",
                "minimax_m2",
                "exaone_moe",
                "kimi_linear",
                "hy_v3",
                "sarvam_mla",
                "deepseek_v32",
                "glm_moe_dsa",
                "hy_v4",
                "dots3_note",
                "minimax_m3_vl_text",
                "glm5_next",
                "deepseek_v4",
            ) and name.endswith("e_score_correction_bias"):
                t[..., t.shape[-1] // 2 :] -= 10.0  # ERNIE's bias is [1, experts]
            if variant == "afmoe" and name.endswith("mlp.expert_bias"):
                t[t.shape[0] // 2 :] -= 10.0
            if variant == "gpt_oss" and name.endswith("mlp.router.bias"):
                t[t.shape[0] // 2 :] -= 100.0


# their last layer routes no token to the upper half of the experts
STARVED = {
    "deepseek_v3",
    "gpt_oss",
    "glm4_moe_lite",
    "ernie4_5_moe",
    "minimax_m2",
    "exaone_moe",
    "kimi_linear",
    "hy_v3",
    "afmoe",
    "sarvam_mla",
    "deepseek_v32",
    "glm_moe_dsa",
    "hy_v4",
    "dots3_note",
    "minimax_m3_vl_text",
    "glm5_next",
    "deepseek_v4",
}


def read_config(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())
