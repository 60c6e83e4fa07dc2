"""MiniMax-M3's text decoder (families/minimax_m3.py, model/block_sparse.py) beyond the parity
checks every family takes: past index_topk_blocks blocks the sparse layers follow their indexers'
choice (Transformers' sparse reading is matched, its dense reading of the same weights is not);
decodes continued from the paged cache (on one rank and, marked slow, on two) and the token engine
equal the whole read; the release's config and tensor names read as Transformers' do, also below a
minimax_m3_vl wrapper; the refusals the seed states. The tiny checkpoint (tests/tiny/minimax_m3.py)
keeps three blocks of four keys per query, two of them local."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.paged import PagedCache
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import check_engine_answers_as_generate
from tests.paged_steps import check_paged_equals_whole, check_ranks_equal_one, random_sequences
from tests.tiny_models import TINY, load_tiny, random_ids

SPARSE = TINY["minimax_m3_vl_text"][2]["sparse_attention_config"]
# 12 keys: every block kept
DENSE_UP_TO = SPARSE["sparse_block_size"] * SPARSE["sparse_topk_blocks"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, Transformers model, our model)."""
    return load_tiny("minimax_m3_vl_text", tmp_path_factory)


def test_more_blocks_than_topk_follow_the_indexers_choice(tiny, tmp_path):
    """Transformers' dense reading (index_topk_blocks above the blocks) of the same weights agrees
    while every block is kept and differs past that, where ours follows the sparse one: ignoring the
    choice would fail here."""
    directory, reference, ours = tiny
    dense_dir = tmp_path / "dense"
    shutil.copytree(directory, dense_dir)
    config = json.loads((dense_dir / "config.json").read_text())
    config["index_topk_blocks"] = 1000
    (dense_dir / "config.json").write_text(json.dumps(config))
    dense_reference = type(reference).from_pretrained(dense_dir, dtype=torch.float32).eval()
    ids = random_ids(32)
    with torch.no_grad():
        logits, sparse, dense = ours(ids), reference(ids).logits, dense_reference(ids).logits
    assert compare(logits, sparse)["max_relative_error"] < 1e-4
    assert compare(dense[:, :DENSE_UP_TO], sparse[:, :DENSE_UP_TO])["max_relative_error"] < 1e-5
    assert compare(logits[:, DENSE_UP_TO:], dense[:, DENSE_UP_TO:])["max_relative_error"] > 1e-2


def test_layer_kinds_and_widths(tiny):
    _, _, model = tiny
    cfg = model.cfg
    assert cfg.mixers == ("attention", "block_sparse_attention", "block_sparse_attention")
    assert cfg.feed_forwards == ("dense", "moe", "moe")
    assert (
        cfg.intermediate_size == 24
        and cfg.moe.intermediate_size == 16
        and cfg.moe.shared_intermediate_size == 16
    )
    assert {r.rotary_dim for r in cfg.layer_rope} == {8}
    assert cfg.swiglu_oai == (1.0, 1.702)


# prefills longer and shorter than the dense reach, decodes that cross it, sequences together
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
    assert driver.length["A"] > DENSE_UP_TO and driver.length["C"] > DENSE_UP_TO
    # every layer keeps 2 key heads of 16 and 2 values of 16; a sparse one its index key (12) behind
    # each value
    assert PagedCache.block_bytes(model, 1) == 4 * (3 * 2 * 16 * 2 + 2 * 2 * 12)


# TP=2 over the static cache is tests/parallel/test_tensor_parallel.py's; this adds the paged one
@pytest.mark.slow
def test_tensor_parallel_ranks_equal_one_rank_over_paged_caches(tiny, tp2):
    """Two ranks each hold one key-value head, its share of index_q and the whole index_k."""
    directory, _, model = tiny
    tokens = random_sequences(4)
    check_ranks_equal_one(tp2, directory, model, tokens, SCHEDULE)


def test_the_token_engine_answers_as_ster_generate(tiny):
    directory, _, _ = tiny
    prompts = ["a prompt longer than the indexer keeps", "short", "another, somewhat longer prompt"]
    check_engine_answers_as_generate(directory, prompts, 10, 16)


_SHARED = ".block_sparse_moe.shared_experts."


def _as_release(directory, target) -> None:
    """The tiny checkpoint as MiniMax publishes it, below a minimax_m3_vl wrapper: the release's
    config keys and tensor names (per-expert w1/w3/w2, separate gate and up projections, index_*
    projections)."""
    shutil.copytree(directory, target)
    text = json.loads((target / "config.json").read_text())
    kinds = [t == "minimax_m3_sparse" for t in text.pop("layer_types")]
    moe = [t == "sparse" for t in text.pop("mlp_layer_types")]
    sparse = {
        "sparse_attention_freq": [int(k) for k in kinds],
        "sparse_score_type": "max",
        "sparse_disable_index_value": 1,
        "sparse_init_block": 0,
    }
    for flat, key in (
        ("index_n_heads", "sparse_num_index_heads"),
        ("index_head_dim", "sparse_index_dim"),
        ("index_block_size", "sparse_block_size"),
        ("index_topk_blocks", "sparse_topk_blocks"),
        ("index_local_blocks", "sparse_local_block"),
    ):
        sparse[key] = text.pop(flat)
    text.update(
        hidden_act="swigluoai",
        sparse_attention_config=sparse,
        moe_layer_freq=[int(m) for m in moe],
        use_gemma_norm=True,
        qk_norm_type="per_head",
        scoring_func="sigmoid",
        attention_output_gate=False,
        rotary_dim=8,
    )
    text.pop("model_type")
    wrapper = {
        "model_type": "minimax_m3_vl",
        "text_config": {**text, "model_type": "minimax_m3_vl_text"},
    }
    (target / "config.json").write_text(json.dumps(wrapper))
    out = {}
    for name, t in load_file(target / "model.safetensors").items():
        if ".mlp.experts.gate_up_proj" in name:
            base = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
            for e, (w1, w3) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = (
                    w1.contiguous(),
                    w3.contiguous(),
                )
        elif ".mlp.experts.down_proj" in name:
            base = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
            for e, w2 in enumerate(t):
                out[f"{base}.{e}.w2.weight"] = w2.contiguous()
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2, dim=0)
            base = name[: -len("gate_up_proj.weight")].replace(".mlp.shared_experts.", _SHARED)
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = (
                gate.contiguous(),
                up.contiguous(),
            )
        elif ".mlp.shared_experts." in name:
            out[name.replace(".mlp.shared_experts.", _SHARED)] = t
        elif ".mlp.gate." in name:
            out[
                name.replace(
                    ".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"
                ).replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
            ] = t
        elif ".self_attn.indexer." in name:
            out[name.replace(".self_attn.indexer.", ".self_attn.index_")] = t
        else:
            out[name] = t
    save_file(
        {f"language_model.{k}": v for k, v in out.items()},
        target / "model.safetensors",
        metadata={"format": "pt"},
    )


def test_the_release_below_its_wrapper_reads_as_transformers_writes_it(tiny, tmp_path):
    directory, _, ours = tiny
    _as_release(directory, tmp_path / "release")
    release = load_model(resolve(str(tmp_path / "release")), "f32").model
    ids = random_ids(24, seed=1)
    with torch.no_grad():
        assert compare(release(ids), ours(ids))["max_relative_error"] < 1e-6


_CONFIG = {
    "model_type": "minimax_m3_vl_text",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "intermediate_size": 16,
    "dense_intermediate_size": 32,
    "shared_intermediate_size": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "hidden_act": "swigluoai",
    "rotary_dim": 8,
    "moe_layer_freq": [0, 1],
    "sparse_attention_config": {
        "sparse_attention_freq": [0, 1],
        "sparse_num_index_heads": 2,
        "sparse_index_dim": 16,
        "sparse_block_size": 4,
        "sparse_topk_blocks": 2,
        "sparse_local_block": 1,
        "sparse_disable_index_value": 1,
    },
}


def test_the_release_config_is_read():
    cfg = from_hf(_CONFIG)
    assert cfg.mixers == ("attention", "block_sparse_attention") and cfg.feed_forwards == (
        "dense",
        "moe",
    )
    assert cfg.layer_rope[0].rotary_dim == 8 and cfg.intermediate_size == 32
    assert cfg.raw["index_topk_blocks"] == 2 and cfg.raw["index_block_size"] == 4


def test_a_config_naming_only_its_architecture_is_the_same_family():
    from ster_dist.config.file import family_of

    raw = {k: v for k, v in _CONFIG.items() if k != "model_type"}
    assert (
        family_of({**raw, "architectures": ["MiniMaxM3SparseForCausalLM"]}) == "minimax_m3_vl_text"
    )


def _sparse(**keys) -> dict:
    return {**_CONFIG, "sparse_attention_config": {**_CONFIG["sparse_attention_config"], **keys}}


@pytest.mark.parametrize(
    "config, message",
    [
        ({**_CONFIG, "hidden_act": "silu"}, "hidden_act 'silu' is not supported"),
        ({**_CONFIG, "attention_output_gate": True}, "attention_output_gate is True"),
        ({**_CONFIG, "use_gemma_norm": False}, "use_gemma_norm is False"),
        ({**_CONFIG, "use_qk_norm": False}, "use_qk_norm is False"),
        ({**_CONFIG, "qk_norm_type": "per_layer"}, "qk_norm_type 'per_layer' is not supported"),
        ({**_CONFIG, "scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
        (_sparse(sparse_score_type="mean"), "sparse_score_type 'mean' is not supported"),
        (_sparse(sparse_init_block=1), "sparse_init_block is 1"),
        (
            _sparse(sparse_disable_index_value=0),
            "sparse_disable_index_value is 0 on a sparse layer",
        ),
        (_sparse(sparse_num_index_heads=3), "sparse_num_index_heads is 3 for 4 attention heads"),
    ],
)
def test_unreadable_configs_are_refused(config, message):
    with pytest.raises(Refusal, match=message):
        from_hf(config)
