"""The shape sweep of tests/config/test_config_shape_sweep.py: each tiny variant's Transformers
config with one size-like key changed, what Transformers builds of it on the meta device (no
weights) and saves, and whether ster_dist reads that checkpoint's names and shapes from the same
config.json.

A variation doubles one positive integer key whose name says it is a size (hidden and intermediate
widths, head counts and dims, expert counts and widths, latent ranks, conv widths, state sizes),
rotates a list of layer kinds by one, or flips tie_word_embeddings; every other key keeps the
variant's value, so sizes that published configs state independently of each other differ here too.

Transformers' checkpoint is what save_pretrained writes: the state dict without tied copies, its
weight conversions reverted; ster_dist's reading is what the loader plans (shard/plan.py build_plan
over the meta decoder's parameters, every parameter filled), without a byte of weights.
"""

from __future__ import annotations

import json
import re

import torch

from tests.tiny_models import TINY, family_of_variant, tiny_config

# names of integer keys that size a tensor; the second pattern drops those that only look like sizes
_SIZE = re.compile(
    r"(size|dim|heads|rank|experts|kernel|conv|state|expand|groups|_L_cache|n_embd|n_head|n_inner"
    r"|d_model|ffn|width)"
)
_NOT_SIZE = re.compile(
    r"(token_id|max_position|window|topk|top_k|per_tok|chunk|position|num_hidden_layers)"
)
# variants saved as a release whose names Transformers never writes (their families read only that
# layout;
# tests/tiny/ rewrites them, and their own parity tests check that layout)
RELEASE_ONLY = {"axk1", "dots3_note"}


def swept_variants() -> list[str]:
    """One variant per family (the first by name): the others differ in switches, not in sizes."""
    first: dict[str, str] = {}
    for variant in sorted(TINY):
        if variant not in RELEASE_ONLY:
            first.setdefault(family_of_variant(variant), variant)
    return sorted(first.values())


def variations(variant: str) -> list[tuple[str, dict]]:
    """(key, change) for each size-like key of the variant's config, as the module docstring
    says."""
    stated = tiny_config(variant).to_dict()
    out = []
    for key, value in stated.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and value > 0 and _SIZE.search(key) and not _NOT_SIZE.search(key):
            out.append((key, {key: value * 2}))
        elif (
            key.endswith("layer_types")
            and isinstance(value, list)
            and len(set(map(str, value))) > 1
        ):
            out.append((key, {key: value[1:] + value[:1]}))
    tied = stated.get("tie_word_embeddings")
    out.append(
        (
            "tie_word_embeddings",
            {"tie_word_embeddings": not tied if isinstance(tied, bool) else False},
        )
    )
    return out


def transformers_checkpoint(variant: str, change: dict) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(config.json, {tensor name: shape}) as Transformers' save_pretrained writes them, built on
    the meta device; raises whatever Transformers raises for a config it refuses."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    config = tiny_config(variant, change)
    with torch.device("meta"):  # initialised as save_pretrained's caller would (that ties the head)
        model = getattr(transformers, TINY[variant][1])(config)
    state = revert_weight_conversion(
        model, remove_tied_weights_from_state_dict(model.state_dict(), model)
    )
    return json.loads(config.to_json_string()), {name: tuple(t.shape) for name, t in state.items()}


def stated_config(variant: str, change: dict) -> dict:
    """The variant's config.json with `change` written over it: the config a user could write even
    where Transformers' config class refuses it."""
    return {**json.loads(tiny_config(variant).to_json_string()), **change}


def ster_dist_refusal(raw: dict, shapes: dict[str, tuple[int, ...]] | None) -> str | None:
    """ster_dist's refusal of `raw` with tensors of `shapes` (of the config alone, building the meta
    decoder, where `shapes` is None), or None where it reads every tensor into a parameter of its
    shape and fills every parameter."""
    from ster_dist.config import from_hf
    from ster_dist.errors import Refusal
    from ster_dist.model.decoder import meta_decoder
    from ster_dist.parallel.linear import module_shards, tied_parameters
    from ster_dist.shard.plan import build_plan

    try:
        cfg = from_hf(raw)
        model = meta_decoder(cfg)
        if shapes is None:
            return None
        shards = module_shards(model)
        copies = {name for _, _, name, _ in tied_parameters(model)}
        plan = build_plan(cfg.spec, cfg, shards, shapes, tied_copies=copies)
        missing = sorted(set(shards) - set(plan.expected))
        if missing:
            return (
                f"parameter {missing[0]} is filled by no checkpoint tensor ({len(missing)} in all)"
            )
    except Refusal as refusal:
        return str(refusal)
    return None


def transformers_forward_failure(variant: str, change: dict) -> str | None:
    """What Transformers raises running a tiny random model of the changed config forward (on the
    CPU, 2 x 9 tokens), or None where it runs: the proof that a refusal of ster_dist matches a
    config Transformers cannot run either."""
    import transformers

    try:
        config = tiny_config(variant, change)
        torch.manual_seed(0)
        model = getattr(transformers, TINY[variant][1])(config).eval()
        with torch.no_grad():
            model(torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0)))
    except Exception as failure:  # noqa: BLE001 - any failure of Transformers' own forward is the evidence
        return f"{type(failure).__name__}: {str(failure).splitlines()[0][:160]}"
    return None
