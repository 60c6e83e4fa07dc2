"""DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa) beyond the parity checks every family
takes: with more keys than index_topk the indexer's choice shapes the output (Transformers' sparse
reading is matched, its dense reading of the same weights is not); no longer than index_topk, the
layers equal dense latent attention (the same weights read as deepseek_v3); decodes continued from
the paged cache, and the token engine, equal the whole read. The tiny checkpoints keep index_topk at
12 (tests/tiny/deepseek.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
from tests.paged_steps import check_paged_equals_whole, check_ranks_equal_one
from tests.tiny_models import TINY, make_tiny

VARIANTS = ["deepseek_v32", "glm_moe_dsa"]
TOPK = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """variant -> (directory, Transformers model, our model)."""
    made = {}

    def get(variant: str):
        if variant not in made:
            assert TINY[variant][2]["index_topk"] == TOPK
            directory = tmp_path_factory.mktemp(variant)
            reference = make_tiny(variant, directory)
            made[variant] = directory, reference, load_model(resolve(str(directory)), "f32").model
        return made[variant]

    return get


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (2, length), generator=torch.Generator().manual_seed(seed))


def _rewrite(source: Path, target: Path, config_change, drop_indexer: bool = False) -> Path:
    """A copy of the checkpoint with its config changed (and, for a dense reading, no indexer
    tensors)."""
    shutil.copytree(source, target)
    path = target / "config.json"
    path.write_text(json.dumps(config_change(json.loads(path.read_text())), indent=2))
    if drop_indexer:
        for file in target.glob("*.safetensors"):
            kept = {k: v for k, v in load_file(file).items() if ".indexer." not in k}
            save_file(kept, file, metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("variant", VARIANTS)
def test_more_keys_than_index_topk_follow_the_indexers_choice(tiny, tmp_path, variant):
    """Transformers' sparse reading is matched; its dense reading (index_topk above the length)
    differs past index_topk keys, so ignoring the choice would fail here."""
    directory, reference, ours = tiny(variant)
    dense_dir = _rewrite(directory, tmp_path / "dense", lambda c: {**c, "index_topk": 1000})
    dense_reference = type(reference).from_pretrained(dense_dir, dtype=torch.float32).eval()
    ids = _ids(32)
    with torch.no_grad():
        logits, sparse, dense = ours(ids), reference(ids).logits, dense_reference(ids).logits
    assert compare(logits, sparse)["max_relative_error"] < 1e-4
    # the same weights
    assert compare(dense[:, :TOPK], sparse[:, :TOPK])["max_relative_error"] < 1e-5
    assert compare(logits[:, TOPK:], dense[:, TOPK:])["max_relative_error"] > 1e-2


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_longer_than_index_topk_equals_dense_latent_attention(tiny, tmp_path, variant):
    """The same weights without their indexers, read as deepseek_v3: equal while a query sees at
    most index_topk keys, apart once it sees more."""
    directory, _, ours = tiny(variant)

    def as_deepseek_v3(config: dict) -> dict:
        return {
            **{k: v for k, v in config.items() if not k.startswith("index") and k != "layer_types"},
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            "rope_interleave": True,
        }

    dense = load_model(
        resolve(str(_rewrite(directory, tmp_path / "v3", as_deepseek_v3, drop_indexer=True))), "f32"
    ).model
    with torch.no_grad():
        assert compare(ours(_ids(TOPK, 1)), dense(_ids(TOPK, 1)))["max_relative_error"] < 1e-5
        longer, dense_longer = ours(_ids(24, 2)), dense(_ids(24, 2))
    assert compare(longer[:, :TOPK], dense_longer[:, :TOPK])["max_relative_error"] < 1e-5
    assert compare(longer[:, TOPK:], dense_longer[:, TOPK:])["max_relative_error"] > 1e-2


# prefills longer and shorter than index_topk, decodes that cross it, sequences decoding together
SCHEDULE = [
    [("A", 14), ("B", 5)],
    [("B", 6), ("C", 3)],
    *[[("A", 1), ("B", 1), ("C", 1)]] * 4,
    [("C", 9), ("A", 1)],
    [("B", 1), ("C", 1)],
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_decodes_from_the_paged_cache_equal_the_whole_read(tiny, variant):
    _, _, model = tiny(variant)
    gen = torch.Generator().manual_seed(3)
    tokens = {name: torch.randint(3, 300, (30,), generator=gen) for name in "ABC"}
    driver = check_paged_equals_whole(model, tokens, SCHEDULE)
    assert driver.length["A"] > TOPK and driver.length["C"] > TOPK
    # each position keeps the latent, the shared rotated key and, on layers with an indexer, the
    # indexer's key
    indexed = [kind == "full" for kind in model.cfg.raw["indexer_types"]]
    assert PagedCache.block_bytes(model, 1) == 4 * sum(16 + 4 + 16 * full for full in indexed)


def test_tensor_parallel_ranks_choose_alike_from_their_paged_caches(tiny, tp2):
    """Each rank holds the whole indexer and caches its keys whole: two ranks' paged steps (GLM-5's
    shared layer included) equal one rank's."""
    directory, _, model = tiny("glm_moe_dsa")
    gen = torch.Generator().manual_seed(4)
    tokens = {name: torch.randint(3, 300, (30,), generator=gen) for name in "ABC"}
    ranks, single = check_ranks_equal_one(tp2, directory, model, tokens, SCHEDULE)
    assert [r["key_shape"] for r in ranks] == [tuple(single.cache.keys[0].shape)] * 2


def test_the_token_engine_answers_as_ster_generate(tiny):
    """Past index_topk tokens, through the engine's paged cache and continuous batching."""
    directory, _, _ = tiny("deepseek_v32")
    prompts = ["a prompt longer than the indexer keeps", "short", "another, somewhat longer prompt"]
    check_engine_answers_as_generate(directory, prompts, 10, 16)


# --------------------------------------------------------------------------------------------------
# the configs: which layers index, how the indexer rotates, what is refused
# --------------------------------------------------------------------------------------------------

_SPARSE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 6,
    "vocab_size": 256,
    "intermediate_size": 128,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "n_group": 4,
    "topk_group": 2,
    "index_topk": 8,
    "index_n_heads": 4,
    "index_head_dim": 16,
}


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"index_topk_freq": 2},
        {"index_topk_freq": 3, "index_skip_topk_offset": 1},
        {"index_topk_pattern": "FFSFSS"},
    ],
)
def test_glm_indexer_types_are_the_config_class_ones(keys):
    from transformers import GlmMoeDsaConfig

    ours = from_hf({"model_type": "glm_moe_dsa", **_SPARSE, **keys})
    assert ours.raw["indexer_types"] == GlmMoeDsaConfig(**_SPARSE, **keys).indexer_types
    assert ours.raw["index_rope_interleave"]


def test_indexer_rotation_is_halves_for_deepseek_and_pairs_for_glm_unless_stated():
    assert not from_hf({"model_type": "deepseek_v32", **_SPARSE}).raw["index_rope_interleave"]
    assert not from_hf(
        {"model_type": "glm_moe_dsa", **_SPARSE, "indexer_rope_interleave": False}
    ).raw["index_rope_interleave"]


@pytest.mark.parametrize(
    "family, keys, message",
    [
        ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank is null"),
        ("glm_moe_dsa", {"indexer_types": ["shared"] + ["full"] * 5}, "the first full"),
        ("glm_moe_dsa", {"indexer_types": ["full"] * 5}, "each of the 6 layers"),
        ("deepseek_v32", {"index_head_dim": 2}, "narrower than the rotated"),
        (
            "deepseek_v32",
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
            "load a BF16 export",
        ),
    ],
)
def test_unreadable_sparse_attention_configs_are_refused(family, keys, message):
    with pytest.raises(Refusal, match=message):
        from_hf({"model_type": family, **_SPARSE, **keys})
