"""Dots3-Note (families/sparse_attention.py) beyond the parity checks every family takes: past
index_topk keys the full layers follow their indexers' choice (Transformers' sparse reading is
matched, its dense reading of the same weights is not); decodes continued from the paged cache, on
one rank and on two, and the token engine equal the whole read; the layer kinds Transformers
derives, and the refusals the seed states (attention adapters included). The tiny checkpoint
(tests/tiny/sparse_attention.py) runs indexed, sliding, indexed layers with index_topk 12 and a
window of 8."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.model.paged import PagedCache
from ster_dist.parity import compare
from tests.engine_checks import check_engine_answers_as_generate
from tests.paged_steps import check_paged_equals_whole, check_ranks_equal_one, random_sequences
from tests.tiny_models import TINY, load_tiny, random_ids

TOPK, WINDOW = 12, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, Transformers model, our model)."""
    assert (
        TINY["dots3_note"][2]["index_topk"] == TOPK
        and TINY["dots3_note"][2]["sliding_window_size"] == WINDOW
    )
    return load_tiny("dots3_note", tmp_path_factory)


def test_more_keys_than_index_topk_follow_the_indexers_choice(tiny, tmp_path):
    """Transformers' dense reading (index_topk above the length) of the same weights agrees up to
    index_topk keys and differs past them, where ours follows the sparse one: ignoring the choice
    would fail here."""
    directory, reference, ours = tiny
    dense_dir = tmp_path / "dense"
    shutil.copytree(directory, dense_dir)
    config = json.loads((dense_dir / "config.json").read_text())
    # Transformers' text class reads the release
    config.update(model_type="dots3_note_text", index_topk=1000)
    (dense_dir / "config.json").write_text(json.dumps(config))
    dense_reference = type(reference).from_pretrained(dense_dir, dtype=torch.float32).eval()
    ids = random_ids(32)
    with torch.no_grad():
        logits, sparse, dense = ours(ids), reference(ids).logits, dense_reference(ids).logits
    assert compare(logits, sparse)["max_relative_error"] < 1e-4
    assert compare(dense[:, :TOPK], sparse[:, :TOPK])["max_relative_error"] < 1e-5
    assert compare(logits[:, TOPK:], dense[:, TOPK:])["max_relative_error"] > 1e-2


def test_each_kind_of_layer_has_its_own_sizes_window_and_base(tiny):
    _, _, model = tiny
    cfg = model.cfg
    assert [cfg.heads(i) for i in range(3)] == [4, 2, 4]
    assert [cfg.mla_of(i).kv_lora_rank for i in range(3)] == [16, 12, 16]
    assert list(cfg.layer_window) == [None, WINDOW, None]
    assert [r.theta for r in cfg.layer_rope] == [20000.0, 5000.0, 20000.0]
    assert cfg.raw["indexer_types"] == ["full", "none", "full"]


# prefills longer and shorter than index_topk and the window, decodes that cross both, sequences
# together
SCHEDULE = [
    [("A", 14), ("B", 5)],
    [("B", 6), ("C", 3)],
    *[[("A", 1), ("B", 1), ("C", 1)]] * 4,
    [("C", 9), ("A", 1)],
    [("B", 1), ("C", 1)],
]


def test_decodes_from_the_paged_cache_equal_the_whole_read(tiny):
    _, _, model = tiny
    tokens = random_sequences(3)
    driver = check_paged_equals_whole(model, tokens, SCHEDULE)
    assert driver.length["A"] > TOPK and driver.length["C"] > TOPK
    # a full layer keeps its latent, shared rotated key and indexer key; the sliding one its own
    # narrower latent
    assert PagedCache.block_bytes(model, 1) == 4 * ((16 + 4 + 16) * 2 + 12 + 4)


# TP=2 over the static cache is tests/parallel/test_tensor_parallel.py's; this adds the paged one
@pytest.mark.slow
def test_tensor_parallel_ranks_equal_one_rank_over_paged_caches(tiny, tp2):
    """Two ranks split each kind's heads (4 and 2) and each hold the whole indexer."""
    directory, _, model = tiny
    tokens = random_sequences(4)
    check_ranks_equal_one(tp2, directory, model, tokens, SCHEDULE)


def test_the_token_engine_answers_as_ster_generate(tiny):
    directory, _, _ = tiny
    prompts = ["a prompt longer than the indexer keeps", "short", "another, somewhat longer prompt"]
    check_engine_answers_as_generate(directory, prompts, 10, 16)


def test_an_attention_adapter_is_refused_at_attach(tiny, tmp_path):
    """The output projection exists on both kinds of layer, but in two shapes: seeds/000 refuses
    attention targets (training refuses them too, tune/spec.py)."""
    from ster_dist.adapters.format import open_adapter
    from ster_dist.adapters.targets import sites_for
    from tests.steer.test_merge import ster_adapter

    directory, _, model = tiny
    ster_adapter(tmp_path / "o.safetensors", directory, ["output"], [0])
    with pytest.raises(
        Refusal, match="the output target is refused on dots3_note: its two kinds of attention"
    ):
        sites_for(open_adapter(tmp_path / "o.safetensors"), model.cfg, str(directory))


# --------------------------------------------------------------------------------------------------
# the configs
# --------------------------------------------------------------------------------------------------

_CONFIG = {
    "model_type": "dots3_note",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 6,
    "vocab_size": 256,
    "intermediate_size": 128,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "num_key_value_heads": 4,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "index_topk": 8,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "swa_num_attention_heads": 2,
    "swa_q_lora_rank": 20,
    "swa_kv_lora_rank": 12,
    "swa_head_dim": 14,
    "swa_qk_nope_head_dim": 10,
    "swa_v_head_dim": 8,
    "swa_num_key_value_heads": 2,
}


@pytest.mark.parametrize("keys", [{}, {"use_sliding_window": False}, {"use_dsa": False}])
def test_layer_kinds_are_the_config_class_ones(keys):
    from transformers import Dots3NoteTextConfig

    ours = from_hf({**_CONFIG, **keys})
    kinds = Dots3NoteTextConfig(
        **{k: v for k, v in _CONFIG.items() if k != "model_type"}, **keys
    ).layer_types
    assert ours.raw["indexer_types"] == [
        "full" if kind == "indexed_attention" else "none" for kind in kinds
    ]
    assert [w is not None for w in ours.layer_window] == [
        kind == "sliding_attention" for kind in kinds
    ]
    assert ours.moe_layers == (False,) + (True,) * 5  # first_k_dense_replace 1


def test_rope_scaling_is_not_applied():
    """vLLM rotates both kinds by their plain base whatever rope_scaling states."""
    cfg = from_hf(
        {
            **_CONFIG,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        }
    )
    assert {r.rope_type for r in cfg.layer_rope} == {"default"}


@pytest.mark.parametrize(
    "keys, bases",
    [
        ({}, (80_000_000.0, 50_000.0)),  # Dots3NoteTextConfig's
        ({"rope_theta": 1e6, "swa_rope_theta": 1e4}, (1e6, 1e4)),  # the released config's keys
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 2e6}}, (2e6, 50_000.0)),
        (
            {
                "rope_parameters": {
                    "indexed_attention": {"rope_theta": 3e6},
                    "sliding_attention": {"rope_theta": 3e4},
                }
            },
            (3e6, 3e4),
        ),  # as Transformers saves them
    ],
)
def test_each_kind_rotates_at_its_base(keys, bases):
    cfg = from_hf({**_CONFIG, **keys})
    assert {(r.theta, w is not None) for r, w in zip(cfg.layer_rope, cfg.layer_window)} == {
        (bases[0], False),
        (bases[1], True),
    }


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"attention_gate_type": "elementwise"}, "attention_gate_type is 'elementwise'"),
        ({"swa_attention_gate_type": "none"}, "swa_attention_gate_type is 'none'"),
        ({"swa_qk_rope_head_dim": 8}, "sliding-window heads rotating another width"),
        ({"q_lora_rank": None}, "q_lora_rank is null"),
        ({"index_head_dim": 2}, "narrower than the rotated"),
        ({"layer_types": ["full_attention"] * 5 + ["chunked_attention"]}, "layer_types"),
    ],
)
def test_unreadable_configs_are_refused(keys, message):
    with pytest.raises(Refusal, match=message):
        from_hf({**_CONFIG, **keys})
