"""Every family Transformers builds reads its config as Transformers does: each size-like key of a
tiny config varied on its own (tests/shape_sweep.py), Transformers' checkpoint built on the meta
device, and ster_dist's shard plan for the same config.json mapping every tensor at Transformers'
shape and filling every parameter, or refusing the config exactly where Transformers refuses it (its
config class or its model), or where Transformers builds the model but its own forward fails
(REFUSED_WHERE_TRANSFORMERS_CANNOT_RUN, each checked by running that forward). A divergence is named
in one line: family, key, value, and what differs.
"""

from __future__ import annotations

import pytest

from tests.shape_sweep import (
    stated_config,
    ster_dist_refusal,
    swept_variants,
    transformers_checkpoint,
    transformers_forward_failure,
    variations,
)

# (variant, key): why ster_dist's refusal stands. Transformers builds these models, and the test
# runs each
# forward to show it fails there too
REFUSED_WHERE_TRANSFORMERS_CANNOT_RUN: dict[tuple[str, str], str] = {
    (
        "phi",
        "num_key_value_heads",
    ): "8 key-value heads over 4 query heads: Transformers' repeat_kv fails",
    (
        "zamba2",
        "num_key_value_heads",
    ): "8 key-value heads over 4 query heads: Transformers' attention fails",
    (
        "zamba2",
        "attention_hidden_size",
    ): "the shared block's width differs from the concatenated input",
    ("zamba2", "attention_head_dim"): "the heads no longer cover attention_hidden_size",
    ("mimo_v2", "num_key_value_heads"): "layer 1's 4 heads cannot group over 8 key-value heads",
    (
        "mimo_v2_flash",
        "num_key_value_heads",
    ): "layer 1's 4 heads cannot group over 8 key-value heads",
    (
        "inkling_text",
        "swa_num_key_value_heads",
    ): "6 sliding heads cannot group over 4 key-value heads",
    (
        "longcat_flash",
        "qk_head_dim",
    ): "qk_head_dim no longer the sum of qk_nope_head_dim and qk_rope_head_dim",
}

# (variant, key; "*" for every variation): divergences the sweep finds that are not fixed yet (issue
# 63). Listed
# so that the rest of the family stays checked; each must still diverge (a fix removes its line)
NOT_FIXED_YET: dict[tuple[str, str], str] = {
    (
        "olmo_hybrid",
        "linear_num_key_heads",
    ): "Transformers saves the joined convolution as three equal thirds; "
    "ster_dist reads q/k/v_conv1d at their own widths",
    ("olmo_hybrid", "linear_num_value_heads"): "as linear_num_key_heads",
    ("olmo_hybrid", "linear_key_head_dim"): "as linear_num_key_heads",
    ("olmo_hybrid", "linear_value_head_dim"): "as linear_num_key_heads",
    (
        "kimi_linear",
        "layer_types",
    ): "an attention layer where kda_layers marks none: its o_proj width differs",
    (
        "granite_swa",
        "layer_types",
    ): "sliding and full layers' rope bases in another order are refused",
    ("granitemoe_swa", "layer_types"): "as granite_swa",
    (
        "opt",
        "word_embed_proj_dim",
    ): "OPT's project_in / project_out around a narrower embedding is not built",
}


def _not_fixed_yet(variant: str, key: str) -> bool:
    return (variant, key) in NOT_FIXED_YET or (variant, "*") in NOT_FIXED_YET


def divergences(variant: str) -> list[str]:
    found = []
    for key, change in variations(variant):
        shown = f"{variant} {key}={change[key]!r}"
        try:
            raw, shapes = transformers_checkpoint(variant, change)
        except Exception as refused:  # noqa: BLE001 - whatever Transformers raises is its refusal
            if ster_dist_refusal(stated_config(variant, change), None) is None:
                why = " ".join(str(refused).split())[:120]
                found.append(
                    f"{shown}: Transformers refuses ({type(refused).__name__}: {why}); ster_dist reads it"
                )
            continue
        refusal = ster_dist_refusal(raw, shapes)
        if refusal is None:
            continue
        if (variant, key) in REFUSED_WHERE_TRANSFORMERS_CANNOT_RUN:
            if transformers_forward_failure(variant, change) is None:
                found.append(
                    f"{shown}: listed as failing in Transformers' forward, which runs; ster_dist: {refusal}"
                )
            continue
        found.append(f"{shown}: Transformers builds and saves it; ster_dist refuses: {refusal}")
    return found


@pytest.mark.parametrize("variant", swept_variants())
def test_family_reads_every_varied_config_as_transformers(variant):
    found = divergences(variant)
    unlisted = [
        line for line in found if not _not_fixed_yet(variant, line.split()[1].split("=")[0])
    ]
    assert not unlisted, "\n".join(unlisted)
    listed = {key for (v, key) in NOT_FIXED_YET if v == variant}
    still = {line.split()[1].split("=")[0] for line in found}
    fixed = {key for key in listed if key != "*" and key not in still} | (
        {"*"} if "*" in listed and not found else set()
    )
    assert not fixed, (
        f"{variant}: {sorted(fixed)} now read as Transformers reads them; drop them from NOT_FIXED_YET"
    )


def test_every_listed_refusal_is_a_swept_key():
    """An exception naming a key the sweep no longer varies would excuse nothing: each must be a
    variation."""
    swept = {(variant, key) for variant in swept_variants() for key, _ in variations(variant)}
    swept |= {(variant, "*") for variant in swept_variants()}
    listed = set(REFUSED_WHERE_TRANSFORMERS_CANNOT_RUN) | set(NOT_FIXED_YET)
    assert listed <= swept, listed - swept
