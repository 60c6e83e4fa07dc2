"""OLMo Hybrid on a tiny checkpoint: Gated DeltaNet layers (model/gated_delta.py) in pre-norm blocks
beside OLMo 3's post-norm attention. A long prompt read in chunks (static cache and paged state
slots) equals one pass, each tensor-parallel rank reads its heads' rows of the separate
convolutions, the layer pattern and norms each layer kind gets, and refusals of configs it cannot
run."""

from __future__ import annotations

import pytest

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.resolve import resolve
from ster_dist.shard.plan import build_plan
from tests.recurrent_checks import (
    check_chunks_equal_one_pass,
    check_driver_slots,
    checkpoint_fixtures,
    edited_copy,
    random_ids,
)
from tests.tiny_models import read_config

tiny, loaded = checkpoint_fixtures("olmo_hybrid")


def test_a_long_prompt_read_in_chunks_equals_one_pass(loaded):
    check_chunks_equal_one_pass(
        loaded.model, random_ids(90, seed=3, batch=2), (17, 1, 40, 29, 1, 1, 1), 96, 1e-4
    )


def test_paged_chunks_continue_each_sequences_state_in_its_slot(loaded):
    tokens = {"long": random_ids(60, seed=4)[0], "short": random_ids(12, seed=5)[0]}
    schedule = [
        [("long", 23), ("short", 9)],
        [("long", 20), ("short", 1)],
        [("short", 1), ("long", 17)],
    ]
    check_driver_slots(loaded.model, tokens, schedule)


def test_linear_layers_are_pre_norm_and_attention_layers_post_norm(tiny):
    cfg = from_hf(read_config(tiny))
    assert cfg.mixers == ("gated_delta", "attention", "gated_delta")
    decoder = meta_decoder(cfg, ParallelCtx())
    linear, attention = decoder.layers[0], decoder.layers[1]
    assert linear.attn_norm is not None and linear.mlp_norm is not None
    assert linear.post_attn_norm is None and linear.post_mlp_norm is None
    assert attention.attn_norm is None and attention.post_attn_norm is not None
    assert linear.token_mixer.beta_scale == 2.0 and linear.token_mixer.eps == 1e-5


def test_tensor_parallel_ranks_read_their_heads_rows_of_each_convolution(tiny):
    cfg = from_hf(read_config(tiny))
    dk, dv, per_key = 12, 6, 2
    linear = "model.layers.0.linear_attn"
    shapes = {f"{linear}.{p}_conv1d.weight": (24, 1, 4) for p in "qkv"}
    shapes[f"{linear}.g_proj.weight"] = (24, cfg.hidden_size)
    for rank in range(2):
        decoder = meta_decoder(cfg, ParallelCtx(rank, 2))
        assert decoder.layers[0].token_mixer.state_shapes() == (
            (2 * dk + per_key * dv, 3),
            (per_key, dk, dv),
        )
        plan = build_plan(cfg.spec, cfg, decoder.shards(), shapes)
        rows = {
            read.param: [(p.rows.start, p.rows.stop) for p in read.pieces] for read in plan.reads
        }
        assert (
            rows["layers.0.mixer.q_conv"]
            == rows["layers.0.mixer.k_conv"]
            == [(rank * dk, (rank + 1) * dk)]
        )
        values = [(rank * per_key * dv, (rank + 1) * per_key * dv)]
        assert rows["layers.0.mixer.v_conv"] == rows["layers.0.mixer.z.weight"] == values


def test_unstated_layer_types_attend_every_fourth_layer_and_a_null_rope_theta_means_no_rotation(
    tiny,
):
    config = {
        **read_config(tiny),
        "layer_types": None,
        "num_hidden_layers": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": None},
    }
    cfg = from_hf(config)
    assert cfg.mixers == ("gated_delta",) * 3 + ("attention",) + ("gated_delta",) * 3 + (
        "attention",
    )
    assert all(rope is None for rope in cfg.layer_rope)
    # as Transformers reads it, a config stating no rotation rotates at 10000
    unstated = from_hf({**config, "rope_parameters": None})
    assert unstated.layer_rope[3] is not None and unstated.layer_rope[3].theta == 10000.0


def test_an_unknown_layer_type_is_refused(tiny, tmp_path):
    directory = edited_copy(
        tiny, tmp_path, layer_types=["linear_attention", "sliding_attention", "linear_attention"]
    )
    with pytest.raises(
        Refusal, match="layer type 'sliding_attention' is not supported for olmo_hybrid"
    ):
        load_model(resolve(str(directory)), "f32")


def test_transformers_joined_convolution_loads_as_the_three_apart(tiny, loaded, tmp_path):
    """Transformers' in-memory layout joins q/k/v_conv1d into one conv1d (queries, keys, values); a
    checkpoint saved so is split back: every rank holds the same parameters as from the separate
    three."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    joined = tmp_path / "joined"
    shutil.copytree(tiny, joined)
    for path in joined.glob("*.safetensors"):
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith(".q_conv1d.weight")]:
            stem = name[: -len("q_conv1d.weight")]
            tensors[stem + "conv1d.weight"] = torch.cat(
                [tensors.pop(f"{stem}{p}_conv1d.weight") for p in "qkv"]
            )
        assert not any("_conv1d" in n for n in tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    for rank, tp in ((0, 1), (0, 2), (1, 2)):
        ctx = ParallelCtx(rank, tp)
        apart = dict(load_model(resolve(str(tiny)), "f32", "cpu", ctx).model.named_parameters())
        together = dict(
            load_model(resolve(str(joined)), "f32", "cpu", ctx).model.named_parameters()
        )
        assert apart.keys() == together.keys()
        assert all(torch.equal(apart[n], together[n]) for n in apart)
    ids = random_ids(12, seed=7)
    whole = load_model(resolve(str(joined)), "f32").model
    with torch.no_grad():
        assert torch.equal(whole(ids), loaded.model(ids))
