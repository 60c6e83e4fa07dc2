"""DeepSeek-V4 (deepseek_v4, ster_dist/families/deepseek_v4.py) beyond the parity checks every
family takes (tests/tiny/deepseek_v4.py: logits, greedy, static cache across window closings,
batching against Transformers; TP=2 and EP=2 in their own files): the indexer's choice and the hash
routing bite, decodes continued from the paged cache and the token engine equal the whole read,
Transformers' in-memory layout and DeepSeek's own without the model. root read alike, older configs'
keys, and the refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.adapters.targets import refuse_family
from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parallel.pipeline import pipeline_refusal
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import check_engine_answers_as_generate
from tests.paged_steps import check_paged_equals_whole, check_ranks_equal_one, random_sequences
from tests.tiny_models import load_tiny, random_ids, with_config


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(directory, Transformers model, our model) of the tiny DeepSeek-V4 (saved in DeepSeek's own
    names)."""
    return load_tiny("deepseek_v4", tmp_path_factory)


def test_the_indexer_choice_and_hash_routing_bite(v4, tmp_path):
    """Keeping every entry, or routing the hash layer by another table, reads otherwise than the
    tiny does (which matches Transformers: tests/families/test_parity.py)."""
    directory, _, ours = v4
    dense = load_model(
        resolve(str(with_config(directory, tmp_path / "dense", {"index_topk": 64}))), "f32"
    ).model
    rerouted = tmp_path / "rerouted"
    shutil.copytree(directory, rerouted)
    for file in rerouted.glob("*.safetensors"):
        tensors = load_file(file)
        tensors = {k: (v + 1) % 8 if k.endswith("tid2eid") else v for k, v in tensors.items()}
        save_file(tensors, file, metadata={"format": "pt"})
    hashed = load_model(resolve(str(rerouted)), "f32").model
    with torch.no_grad():
        ids = random_ids(40)
        for other in (dense, hashed):
            assert compare(other(ids), ours(ids))["max_relative_error"] > 1e-3


# windows of both rates close inside prefill chunks and between decodes; sequences at unlike lengths
# share steps
SCHEDULE = [
    [("A", 13), ("B", 5)],
    [("B", 6), ("C", 3)],
    *[[("A", 1), ("B", 1), ("C", 1)]] * 5,
    [("C", 9), ("A", 1)],
    [("B", 1), ("C", 1)],
]


def test_decodes_from_the_paged_cache_equal_the_whole_read(v4):
    """Each step rebuilds the entries from the raw projections the paged cache keeps per
    position."""
    _, _, model = v4
    check_paged_equals_whole(model, random_sequences(3), SCHEDULE)


# TP=2 logits are tests/parallel/test_tensor_parallel.py's; this adds the paged steps (~1 min)
@pytest.mark.slow
def test_tensor_parallel_ranks_over_paged_caches_equal_one_rank(v4, tp2):
    """Query heads by whole output groups, their sinks and o_a_proj rows split over two ranks; the
    key-value head, compressors and indexer whole on each: two ranks' paged steps equal one
    rank's."""
    directory, _, model = v4
    check_ranks_equal_one(tp2, directory, model, random_sequences(4), SCHEDULE)


def test_the_token_engine_answers_as_ster_generate(v4):
    directory, _, _ = v4
    prompts = [
        "a prompt longer than the sliding window keeps",
        "short",
        "another, somewhat longer prompt",
    ]
    check_engine_answers_as_generate(directory, prompts, 10, 16)


def _rewritten(directory: Path, target: Path, names) -> Path:
    shutil.copytree(directory, target)
    for file in target.glob("*.safetensors"):
        file.unlink()
    save_file(names, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_transformers_in_memory_layout_and_the_release_without_root_read_alike(v4, tmp_path):
    """Transformers' module names (stacked experts, attn_hc, compressor.indexer) and DeepSeek's own
    release names without the model. root (embed, head, hc_head_fn, layers.{i}.attn.wq_a,
    ffn.experts.{e}.w1) load to the same model."""
    directory, reference, ours = v4
    in_memory = {k: v.contiguous() for k, v in reference.state_dict().items() if "rotary" not in k}
    saved = {}
    for file in directory.glob("*.safetensors"):
        saved.update(load_file(file))
    release = {}
    for name, tensor in saved.items():
        name = (
            name.removeprefix("model.")
            .replace("embed_tokens.", "embed.")
            .replace("hc_head.hc_", "hc_head_")
        )
        release[name] = tensor
    ids = random_ids(24, seed=5)
    with torch.no_grad():
        want = ours(ids)
        for label, names in (("in_memory", in_memory), ("release", release)):
            model = load_model(
                resolve(str(_rewritten(directory, tmp_path / label, names))), "f32"
            ).model
            assert compare(model(ids), want)["max_relative_error"] < 1e-6, label


_CONFIG = {
    "model_type": "deepseek_v4",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 5,
    "vocab_size": 256,
    "head_dim": 16,
    "q_lora_rank": 24,
    "o_groups": 2,
    "o_lora_rank": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "index_head_dim": 8,
    "index_n_heads": 4,
}


def test_older_configs_and_unstated_keys_read_as_the_config_class_does():
    from transformers import DeepseekV4Config

    legacy = {
        **_CONFIG,
        "compress_ratios": [0, 4, 128, 4, 0],
        "num_hash_layers": 2,
        "qk_rope_head_dim": 8,
    }
    theirs = DeepseekV4Config(**{k: v for k, v in legacy.items() if k != "model_type"})
    ours = from_hf(legacy)
    assert ours.raw["v4_layer_types"] == theirs.layer_types
    assert ours.raw["v4_mlp_layer_types"] == theirs.mlp_layer_types
    assert ours.raw["qk_rope_head_dim"] == theirs.qk_rope_head_dim
    assert [m is not None and m.hash_vocab > 0 for m in ours.layer_moe] == [
        True,
        True,
        False,
        False,
        False,
    ]
    plain = DeepseekV4Config(**{k: v for k, v in _CONFIG.items() if k != "model_type"})
    ours = from_hf(_CONFIG)
    assert ours.raw["v4_layer_types"] == plain.layer_types
    assert ours.raw["v4_compress_rates"] == plain.compress_rates
    assert (
        ours.moe.scoring == "sqrtsoftplus"
        and ours.moe.scaling_factor == plain.routed_scaling_factor
    )
    assert (
        ours.hyper_streams == plain.hc_mult
        and ours.raw["hyper_sinkhorn_iters"] == plain.hc_sinkhorn_iters
    )


@pytest.mark.parametrize(
    "change, words",
    [
        ({"hc_mult": 0}, "hc_mult is 0"),
        ({"layer_types": ["full_attention"] * 5}, "layer_types must name"),
        ({"o_groups": 3}, "do not form o_groups 3 groups"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            "the published DeepSeek-V4 weights are FP8 and FP4",
        ),
    ],
)
def test_refusals(change, words):
    with pytest.raises(Refusal, match=words):
        from_hf({**_CONFIG, **change})


def test_the_quantized_releases_are_refused_before_any_weight_is_fetched():
    from ster_dist.config.file import gate

    release = {
        **_CONFIG,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        },
    }
    with pytest.raises(Refusal, match="the published DeepSeek-V4 weights are FP8 and FP4"):
        gate(release, "deepseek-ai/DeepSeek-V4-Flash")


def test_adapters_and_pipeline_stages_are_refused():
    with pytest.raises(Refusal, match="adapters on deepseek_v4 are refused"):
        refuse_family("deepseek_v4")
    assert "hyper-connected residual streams" in pipeline_refusal(from_hf(_CONFIG), 2)
