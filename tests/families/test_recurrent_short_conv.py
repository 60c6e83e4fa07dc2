"""The short convolution (LFM2): a long prompt read in chunks through the cache equals one pass, the
state each tensor-parallel rank keeps, the family's config rules (layer kinds, the derived
feed-forward width) and the refusals of a bad kernel width and of an LFM2-MoE selection bias of the
wrong length. Parity with Transformers is tests/families/test_parity.py's (variants lfm2*)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.model.paged import PagedCache
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.tiny_models import make_tiny


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    cache = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = tmp_path_factory.mktemp(variant)
            make_tiny(variant, cache[variant])
        return cache[variant]

    return get


@pytest.fixture(scope="module", params=["lfm2", "lfm2_biased", "lfm2_moe"])
def loaded(request, made):
    return load_model(resolve(str(made(request.param))), "f32")


def test_a_long_prompt_read_in_chunks_equals_one_pass(loaded):
    ids = torch.randint(3, 300, (2, 45), generator=torch.Generator().manual_seed(3))
    model = loaded.model
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache(2, 45)
        # chunks shorter and longer than the kernel, so a state carries over both ways
        parts = [
            model(ids[:, a:b], cache=cache)
            for a, b in ((0, 2), (2, 19), (19, 20), (20, 33), (33, 45))
        ]
    assert compare(torch.cat(parts, dim=1), whole)["max_relative_error"] < 1e-5


def _raw(**keys) -> dict:
    return {
        "model_type": "lfm2",
        "vocab_size": 100,
        "hidden_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "layer_types": ["conv", "full_attention", "conv"],
        "conv_L_cache": 4,
        **keys,
    }


def test_each_rank_keeps_the_state_of_its_own_channels():
    cfg = from_hf(_raw(hidden_size=51, num_attention_heads=3, num_key_value_heads=1))
    for rank, channels in ((0, 25), (1, 26)):  # an odd width: the shares differ by one channel
        model = meta_decoder(cfg, ParallelCtx(tp_rank=rank, tp_size=2))
        mixer = model.layers[0].token_mixer
        assert mixer.state_shapes() == ((channels, 3),)
        assert tuple(mixer.in_proj.weight.shape) == (3 * channels, 51)
        assert tuple(mixer.out_proj.weight.shape) == (51, channels)
        # the attention layer keeps keys, the convolutions a state
        assert not hasattr(model.layers[1].token_mixer, "state_shapes")
    single = meta_decoder(cfg)
    assert PagedCache.state_bytes(single) == 2 * 51 * 3 * 4


def test_layer_kinds_and_the_derived_feed_forward_width():
    cfg = from_hf(_raw())
    assert cfg.mixers == ("short_conv", "attention", "short_conv")
    assert cfg.intermediate_size == 256  # 2/3 of 96 = 64, rounded up to block_multiple_of 256
    assert from_hf(_raw(block_auto_adjust_ff_dim=False)).intermediate_size == 96
    assert (
        from_hf(_raw(block_multiple_of=10, block_ffn_dim_multiplier=1.5)).intermediate_size == 100
    )
    # a null multiplier: no rounding
    assert from_hf(_raw(block_ffn_dim_multiplier=None)).intermediate_size == 64
    # LFM2-MoE: num_dense_layers dense feed-forwards (of intermediate_size as stated), then experts
    moe = from_hf(
        _raw(
            model_type="lfm2_moe",
            num_experts=4,
            num_experts_per_tok=2,
            num_dense_layers=1,
            use_expert_bias=None,
        )
    )
    assert moe.feed_forwards == ("dense", "moe", "moe") and moe.intermediate_size == 96
    assert moe.moe.topk_method == "noaux_tc" and moe.moe.correction_bias and moe.moe.renormalize
    assert (
        from_hf(
            _raw(model_type="lfm2_moe", num_experts=4, num_experts_per_tok=2, use_expert_bias=False)
        ).moe.topk_method
        == "greedy"
    )
    # without layer_types, full_attn_idxs names the attention layers
    cfg = from_hf({k: v for k, v in _raw(full_attn_idxs=[2]).items() if k != "layer_types"})
    assert cfg.mixers == ("short_conv", "short_conv", "attention")
    assert cfg.layer_rope[0] is None and cfg.layer_rope[2] is not None


@pytest.mark.parametrize(
    "keys, named",
    [
        (dict(conv_L_cache=0), "conv_L_cache"),
        (dict(conv_bias="yes"), "conv_bias"),
        (dict(layer_types=["conv", "mamba", "conv"]), "layer_types"),
        (dict(block_multiple_of=0), "block_multiple_of"),
        (dict(block_ffn_dim_multiplier="x"), "block_ffn_dim_multiplier"),
        (
            dict(model_type="lfm2_moe", num_experts=4, num_experts_per_tok=2, num_dense_layers=-1),
            "num_dense_layers",
        ),
    ],
)
def test_a_bad_config_value_is_refused_by_name(keys, named):
    with pytest.raises(Refusal, match=named):
        meta_decoder(from_hf(_raw(**keys)))


def test_a_selection_bias_not_one_per_expert_is_refused_by_name(made, tmp_path):
    shutil.copytree(made("lfm2_moe"), tmp_path / "short")
    path = tmp_path / "short" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.2.feed_forward.expert_bias"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(path))
    with pytest.raises(Refusal, match=name.replace(".", r"\.")):
        load_model(resolve(str(tmp_path / "short")))
