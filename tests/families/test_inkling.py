"""Inkling (ster_dist/families/inkling.py, model/inkling.py) beyond tests/families/test_parity.py: a
long prompt read in chunks (static cache, and paged steps with a state slot per sequence) equals one
pass and Transformers; every layer keeps its keys and its four short convolutions' windows; left
padding leaves the windows as a fresh sequence's; `ster generate` (the paged token engine) answers
as Transformers and the engine's continuous batch equals each request alone; at TP=2 each rank holds
its heads' share (and their convolution channels) of both layer shapes; Thinking Machines' own
config keys are read as Transformers reads them; bad config values are refused in one line naming
the key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ster_dist.adapters.targets import refuse_family
from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.spawn import SpawnGroup
from tests.cli_run import cli_generate
from tests.recurrent_checks import (
    LONG,
    PagedStatesOnRank,
    check_left_padding,
    check_long_prompt_in_chunks,
    check_paged_steps,
    one_line_refusal,
    paged_tokens,
    random_ids,
    run_paged,
    variants_fixture,
)
from tests.engine.test_recurrent_engine import alone, open_engine, prompts, run_all

VARIANTS = ["inkling_text", "inkling_text_moe"]
CONVS = ("k_sconv", "v_sconv", "attn_sconv", "mlp_sconv")
# the tiny sizes (tests/tiny/inkling.py): sliding layers 0 and 2, full layer 1: (heads, key-value
# heads, width)
SHAPES = {0: (6, 2, 8), 1: (4, 2, 16), 2: (6, 2, 8)}
HIDDEN, KERNEL = 48, 4

tiny = variants_fixture(VARIANTS)


def _conv_keys(layers: int) -> set:
    return {(i, name) for i in range(layers) for name in CONVS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_prompt_in_chunks_equals_one_pass_and_transformers(tiny, variant):
    reference, model = tiny[variant][:2]
    cache = check_long_prompt_in_chunks(model, reference)
    # every layer kept its keys (all LONG positions) and the windows of its four convolutions
    assert set(cache.states) == _conv_keys(len(model.layers))
    assert all(keys is not None and bool(cache.valid[:, :LONG].all()) for keys in cache.keys)


def test_left_padding_leaves_every_window_as_a_fresh_sequences(tiny):
    check_left_padding(tiny["inkling_text"][1])


def test_paged_steps_carry_each_sequences_windows_beside_its_keys(tiny):
    """Prefill chunks of two sequences in their own state slots, packed with each other's decodes,
    equal whole reads; the paged cache holds blocks of keys and a window per slot for every
    convolution (the variant with a dense layer and routed ones)."""
    variant = "inkling_text_moe"
    model = tiny[variant][1]
    cache = check_paged_steps(model, paged_tokens(), variant)
    assert all(k is not None for k in cache.keys) and set(cache.states) == _conv_keys(
        len(model.layers)
    )


def test_ster_generate_answers_as_transformers(tiny):
    """`ster generate` (the paged token engine, tokenizer and all) against Transformers' greedy
    tokens."""
    reference, directory = tiny["inkling_text"][0], tiny["inkling_text"][3]
    prompt = "the quick brown fox jumps over the lazy dog"
    tokenizer = Tokenizer.from_directory(resolve(str(directory)).directory)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[
            0, len(ids) :
        ].tolist()
    if 2 in want:  # the engine stops at the end-of-sequence id
        want = want[: want.index(2)]
    got = cli_generate(
        f"--model={directory}", f"--prompt={prompt}", "--chat-template=off", "--max-new-tokens=6"
    )
    assert got["prompt_tokens"] == len(ids)
    assert got["text"] == tokenizer.decode(want)


def test_engine_batch_equals_each_alone(tiny):
    directory, model = tiny["inkling_text_moe"][3], tiny["inkling_text_moe"][1]
    ps = prompts(3, seed=1, lo=3, hi=20)
    lengths = [5, 3, 6]
    with open_engine(directory, max_step_tokens=6) as engine:  # long prompts read in several chunks
        got = run_all(engine, ps, lengths)
        stats = engine.stats()
    for p, n, tokens in zip(ps, lengths, got):
        assert tokens == alone(model, p, n)
    assert stats["state_bytes"] > 0 and stats["prefix_caching"] is False


def test_each_rank_holds_its_heads_and_their_convolution_channels(tiny):
    cfg = from_hf(tiny["inkling_text"][2])
    for rank in range(2):
        model = meta_decoder(cfg, ParallelCtx(rank, 2))
        for i, (heads, kv, d) in SHAPES.items():
            block = model.layers[i]
            attn = block.attn
            assert attn.kv_shape == ((kv // 2, d), (kv // 2, d))
            assert tuple(attn.q.weight.shape) == (heads // 2 * d, HIDDEN)
            assert tuple(attn.r.weight.shape) == (heads // 2 * 4, HIDDEN)  # d_rel 4 per head
            # the window, else rel_extent
            assert tuple(attn.rel.weight.shape) == (4, 8 if i != 1 else 16)
            assert (
                attn.k_sconv.state_shapes()
                == attn.v_sconv.state_shapes()
                == ((kv // 2 * d, KERNEL - 1),)
            )
            assert tuple(attn.k_sconv.weight.shape) == (kv // 2 * d, 1, KERNEL)
            # the sublayer outputs' convolutions read the reduced hidden state: whole on every rank
            assert (
                block.attn_sconv.state_shapes()
                == block.mlp_sconv.state_shapes()
                == ((HIDDEN, KERNEL - 1),)
            )


@pytest.mark.slow  # two spawned ranks: about a minute on two shared cores
def test_tensor_parallel_paged_steps_agree_with_one_rank(tiny):
    variant, tokens = "inkling_text_moe", paged_tokens()
    with SpawnGroup(2) as group:
        group.call("load", resolve(str(tiny[variant][3])), "f32", "cpu")
        ranks = group.on(PagedStatesOnRank).run(tokens)
    _, single, _ = run_paged(tiny[variant][1], tokens)
    for tp2, tp1 in zip(ranks[0]["logits"], single):
        assert compare(tp2, tp1)["max_relative_error"] < 1e-5
    # the first key, (0, "attn_sconv"): the whole hidden width on each rank, three slots
    assert [r["state_shapes"] for r in ranks] == [[(3, HIDDEN, KERNEL - 1)]] * 2


def test_thinking_machines_config_keys_read_as_transformers_reads_them(tiny, tmp_path):
    """dense_intermediate_size is the dense width and intermediate_size then the experts';
    sconv_kernel_size the convolutions' kernel; model_max_length the context: the same model, the
    same logits."""
    directory, model = tiny["inkling_text_moe"][3], tiny["inkling_text_moe"][1]
    edited = tmp_path / "edited"
    shutil.copytree(directory, edited)
    config = json.loads((edited / "config.json").read_text())
    text = config["text_config"]
    text["dense_intermediate_size"] = text["intermediate_size"]
    text["intermediate_size"] = text.pop("moe_intermediate_size")
    text["sconv_kernel_size"] = text.pop("conv_kernel_size")
    text["model_max_length"] = text.pop("max_position_embeddings")
    (edited / "config.json").write_text(json.dumps(config))
    loaded = load_model(resolve(str(edited)), "f32")
    assert loaded.cfg.intermediate_size == 80 and loaded.cfg.moe.intermediate_size == 24
    ids = random_ids(20)
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), model(ids))


@pytest.mark.parametrize(
    "stated, windows, feed_forwards",
    [
        ({"local_layer_ids": [1], "dense_mlp_idx": 2}, [None, 8, None], ("dense", "dense", "moe")),
        # Transformers' defaults: all but every sixth slide, all routed
        ({}, [8, 8, 8], ("moe", "moe", "moe")),
    ],
)
def test_layer_kinds_without_layer_types(tiny, stated, windows, feed_forwards):
    """Thinking Machines' configs state local_layer_ids and dense_mlp_idx where Transformers writes
    layer_types and mlp_layer_types."""
    raw = tiny["inkling_text_moe"][2]
    text = {
        k: v for k, v in raw["text_config"].items() if k not in ("layer_types", "mlp_layer_types")
    }
    cfg = from_hf({**raw, "text_config": {**text, **stated}})
    assert cfg.feed_forwards == feed_forwards
    assert [block.attn.window for block in meta_decoder(cfg).layers] == windows


def test_adapters_are_refused(tiny):
    with pytest.raises(Refusal, match="adapters on inkling_text are refused"):
        refuse_family(from_hf(tiny["inkling_text"][2]).family)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"layer_types": ["hybrid", "sliding", "hybrid"]}, "layer_types"),
        ({"layer_types": ["hybrid"]}, "layer_types"),
        ({"mlp_layer_types": ["dense", "moe", "dense"]}, "mlp_layer_types"),
        ({"conv_kernel_size": 0}, "conv_kernel_size"),
        ({"d_rel": "four"}, "d_rel"),
        ({"logits_mup_width_multiplier": 0}, "logits_mup_width_multiplier"),
        ({"log_scaling_n_floor": -1}, "log_scaling_n_floor"),
    ],
)
def test_bad_config_values_are_refused(tiny, change, words):
    raw = tiny["inkling_text"][2]
    assert words in one_line_refusal({**raw, "text_config": {**raw["text_config"], **change}})
