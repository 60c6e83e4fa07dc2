"""Gemma 4's configs (families/gemma4.py): what the seed refuses, each in one line, and the two ways
a config states its full layers' head sizes (the published checkpoints' global_head_dim and
num_global_key_value_heads, Transformers 5's per_layer_config) read alike. Logits, caches, batches,
TP=2 and EP=2 are checked against Transformers through tests/tiny/gemma4.py (test_parity,
test_paged_cache, test_tensor_parallel, test_moe, test_text_wrappers)."""

from __future__ import annotations

import copy

import pytest

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.families.registry import status

_LAYERS = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
]
# as the published checkpoints state it: the full layers' sizes as global_* keys
PUBLISHED = {
    "model_type": "gemma4_text",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "sliding_window": 8,
    "layer_types": _LAYERS,
    "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
        },
    },
}


def _with(**changes) -> dict:
    raw = copy.deepcopy(PUBLISHED)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def test_both_families_are_parity_checked():
    assert status("gemma4_text") == status("gemma4_unified_text") == "parity-checked"


def test_published_and_transformers_per_layer_sizes_read_alike():
    published = from_hf(PUBLISHED)
    full = {
        i: {"head_dim": 32, "num_key_value_heads": 1}
        for i, kind in enumerate(_LAYERS)
        if kind == "full_attention"
    }
    saved = from_hf(
        _with(
            global_head_dim=None,
            num_global_key_value_heads=None,
            per_layer_config={str(i): sizes for i, sizes in full.items()},
        )
    )
    assert published.layer_head_dim == saved.layer_head_dim
    assert published.layer_kv_heads == saved.layer_kv_heads
    assert published.layer_rope == saved.layer_rope
    # full layers only: wider heads, values from keys, a rotation over the whole wider head
    assert [published.head_dim_of(i) != published.head_dim for i in range(5)] == [
        k == "full_attention" for k in _LAYERS
    ]
    assert published.layer_value_from_key == tuple(k == "full_attention" for k in _LAYERS)
    assert published.layer_rope[2].rotary_dim == published.head_dim_of(2)
    # the last two layers reuse the last unshared layer of their kind
    last_of = {kind: max(i for i in range(3) if _LAYERS[i] == kind) for kind in set(_LAYERS)}
    assert published.layer_kv_source == (None, None, None, last_of[_LAYERS[3]], last_of[_LAYERS[4]])


def test_per_layer_config_keys_zero_padded_as_transformers_writes_them_read_as_layer_numbers():
    """Of ten layers or more Transformers 5 writes per_layer_config's keys padded to one width ("05"
    of twelve): read as layer numbers, layer 5 is as wide as global_head_dim says, as layer 11
    is."""
    kinds = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    published = from_hf(_with(num_hidden_layers=12, layer_types=kinds, num_kv_shared_layers=0))
    padded = {
        f"{i:02d}": {"head_dim": 32, "num_key_value_heads": 1}
        for i, kind in enumerate(kinds)
        if kind == "full_attention"
    }
    assert list(padded) == ["05", "11"]
    saved = from_hf(
        _with(
            num_hidden_layers=12,
            layer_types=kinds,
            num_kv_shared_layers=0,
            global_head_dim=None,
            num_global_key_value_heads=None,
            per_layer_config=padded,
        )
    )
    assert saved.layer_head_dim == published.layer_head_dim and published.head_dim_of(5) == 32
    assert saved.layer_kv_heads == published.layer_kv_heads
    with pytest.raises(Refusal) as info:
        from_hf(_with(global_head_dim=None, per_layer_config={"full": {"head_dim": 32}}))
    assert "per_layer_config has 'full', not a layer number below 5" in str(info.value)
    assert "\n" not in str(info.value)


def test_without_attention_k_eq_v_full_layers_keep_the_key_value_heads_and_their_values():
    cfg = from_hf(_with(attention_k_eq_v=False))
    assert cfg.layer_kv_heads == (cfg.num_kv_heads,) * 5 and not any(cfg.layer_value_from_key)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(use_bidirectional_attention="all"), 'use_bidirectional_attention is "all"'),
        (
            dict(use_double_wide_mlp=True),
            "use_double_wide_mlp is set; double-wide feed-forwards are not supported",
        ),
        (dict(global_head_dim=None), "global_head_dim is unstated"),
        (dict(layer_types=None), "layer_types is unstated"),
        (
            dict(
                rope_parameters={"full_attention": PUBLISHED["rope_parameters"]["full_attention"]}
            ),
            "the sliding-window rotation base is unstated",
        ),
        (
            dict(
                rope_parameters={
                    **PUBLISHED["rope_parameters"],
                    "sliding_attention": {
                        "rope_type": "linear",
                        "factor": 2.0,
                        "rope_theta": 10000.0,
                    },
                }
            ),
            "the sliding_attention rotation is scaled",
        ),
        (
            dict(
                layer_types=["sliding_attention"] * 4 + ["full_attention"], num_kv_shared_layers=1
            ),
            "leaves no earlier full_attention layer",
        ),
    ],
)
@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_unified_text"])
def test_what_the_seed_refuses_is_refused_in_one_line(family, changes, message):
    with pytest.raises(Refusal) as info:
        from_hf({**_with(**changes), "model_type": family})
    assert message in str(info.value) and "\n" not in str(info.value)
