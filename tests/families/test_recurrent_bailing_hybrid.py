"""Ling 3.0 (bailing_hybrid: Kimi delta attention with full-rank gates and a bounded decay,
head-gated latent attention, DeepSeek-V3's experts) on a tiny checkpoint: the layer kinds its config
states, a long prompt read in chunks (static cache and paged state slots) equal to one pass and to
Transformers, the unbounded decay (kda_safe_gate false) against Transformers, each tensor-parallel
rank's rows of the gates, and refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.shard.plan import build_plan
from tests.recurrent_checks import (
    check_chunks_equal_one_pass,
    check_driver_slots,
    make_checkpoint,
    random_ids,
)
from tests.tiny_models import BASE_CONFIG, TINY, read_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "bailing_hybrid")


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(resolve(str(tiny[0])), "f32")


def test_the_layer_types_and_mlp_layer_types_pick_the_kinds(tiny):
    cfg = from_hf(read_config(tiny[0]))
    assert cfg.mixers == ("kimi_delta", "kimi_delta", "latent_attention", "kimi_delta")
    assert cfg.feed_forwards == ("dense", "moe", "moe", "moe")
    assert cfg.moe.scoring == "sigmoid" and cfg.moe.correction_bias and cfg.moe.renormalize
    assert cfg.moe.n_group == 2 and cfg.moe.topk_group == 1 and cfg.moe.scaling_factor == 2.5


def test_a_long_prompt_read_in_chunks_equals_one_pass_and_transformers(tiny, loaded):
    check_chunks_equal_one_pass(
        loaded.model, random_ids(90, seed=3, batch=2), (17, 1, 40, 29, 1, 1, 1), 96, 1e-4, tiny[1]
    )


def test_paged_chunks_continue_each_sequences_state_in_its_slot(loaded):
    tokens = {"long": random_ids(50, seed=4)[0], "short": random_ids(10, seed=5)[0]}
    schedule = [
        [("long", 23), ("short", 8)],
        [("long", 20), ("short", 1)],
        [("short", 1), ("long", 7)],
    ]
    check_driver_slots(loaded.model, tokens, schedule)


def test_the_unbounded_decay_equals_transformers(tmp_path):
    import transformers

    from tests.tiny_tokenizer import build_tiny_tokenizer

    config_cls, model_cls, kwargs = TINY["bailing_hybrid"]
    config = getattr(transformers, config_cls)(**{**BASE_CONFIG, **kwargs, "kda_safe_gate": False})
    torch.manual_seed(1)
    reference = getattr(transformers, model_cls)(config).eval()
    reference.save_pretrained(tmp_path, safe_serialization=True)
    build_tiny_tokenizer(tmp_path)
    ids = random_ids(30, seed=7, batch=2)
    with torch.no_grad():
        ours = load_model(resolve(str(tmp_path)), "f32").model(ids)
        theirs = reference(ids).logits
    assert compare(ours, theirs)["max_relative_error"] < 1e-4


def test_tensor_parallel_ranks_read_their_heads_rows_of_the_gates(tiny):
    cfg = from_hf(read_config(tiny[0]))
    dk, heads, hidden = 12, 4, cfg.hidden_size
    attn = "model.layers.{}.attention"
    shapes = {
        f"{attn.format(0)}.f_proj.weight": (heads * dk, hidden),
        f"{attn.format(0)}.g_proj.weight": (heads * dk, hidden),
        f"{attn.format(0)}.A_log": (heads,),
        f"{attn.format(0)}.dense.weight": (hidden, heads * dk),
        # the latent attention layer's g_proj: one row a head
        f"{attn.format(2)}.g_proj.weight": (4, hidden),
        f"{attn.format(2)}.dense.weight": (hidden, 4 * 10),
    }
    for rank in range(2):
        decoder = meta_decoder(cfg, ParallelCtx(rank, 2))
        assert decoder.layers[0].token_mixer.state_shapes() == ((3 * 2 * dk, 3), (2, dk, dk))
        plan = build_plan(cfg.spec, cfg, decoder.shards(), shapes)
        reads = {read.param: read.pieces for read in plan.reads}
        rows = {
            param: [(p.rows.start, p.rows.stop) for p in pieces]
            for param, pieces in reads.items()
            if all(p.rows is not None for p in pieces)
        }
        mine = [(rank * 2 * dk, (rank + 1) * 2 * dk)]
        assert rows["layers.0.mixer.f.weight"] == rows["layers.0.mixer.g.weight"] == mine
        assert rows["layers.0.mixer.A_log"] == [(2 * rank, 2 * rank + 2)]
        assert [(p.cols.start, p.cols.stop) for p in reads["layers.0.mixer.out.weight"]] == mine
        assert rows["layers.2.attn.head_gate.weight"] == [(2 * rank, 2 * rank + 2)]
        assert [(p.cols.start, p.cols.stop) for p in reads["layers.2.attn.o.weight"]] == [
            (20 * rank, 20 * rank + 20)
        ]


def _edited(tiny, tmp_path, **changes):
    directory = tmp_path / "edited"
    shutil.copytree(tiny[0], directory)
    config = read_config(directory)
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(kv_lora_rank=None), "kv_lora_rank is not stated"),
        (dict(layer_types=["linear_attention"] * 3), "layer_types must list"),
        (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types must list"),
        (dict(kda_lower_bound=2.0), "kda_lower_bound"),
        (dict(linear_num_heads=3), "fewer than the 4"),
    ],
)
def test_configs_it_cannot_run_are_refused(tiny, tmp_path, changes, words):
    directory = _edited(tiny, tmp_path, **changes)
    with pytest.raises(Refusal) as caught:
        tp = 4 if "linear_num_heads" in changes else 1
        cfg = from_hf(read_config(directory))
        for rank in range(tp):
            meta_decoder(cfg, ParallelCtx(rank, tp))
    assert words in str(caught.value) and "\n" not in str(caught.value)
