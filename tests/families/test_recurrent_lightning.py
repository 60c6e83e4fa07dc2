"""The lightning-attention layer kind (model/lightning.py) on tiny MiniMax checkpoints: its block
scan against Transformers' lightning attention (its block form and its recurrent decode form), a
long prompt read in chunks (static cache and paged state slots, and the token engine's continuous
batch) equal to one pass, left padding leaving the state alone, each tensor-parallel rank's share of
heads and checkpoint rows, MiniMax-Text-01's own config, and refusals of configs it cannot run."""

from __future__ import annotations

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.model.lightning import lightning_scan, slopes
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.shard.plan import build_plan
from tests.recurrent_checks import (
    check_chunks_equal_one_pass,
    check_driver_slots,
    check_left_padding,
    checkpoint_fixtures,
    edited_copy,
    make_checkpoint,
    random_ids,
)
from tests.tiny_models import read_config

tiny, loaded = checkpoint_fixtures("minimax")


@pytest.mark.parametrize("length", [1, 7, 8, 29])
def test_the_scan_equals_transformers_block_form_and_its_decode_form(length):
    """Transformers' MiniMaxLightningAttention on its identity projections and norm reads the scan's
    outputs: in one call (its blocks) and one token at a time from its cache (its recurrent form),
    state included."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention

    heads, d = 3, 4
    config = MiniMaxConfig(
        hidden_size=heads * d,
        num_attention_heads=heads,
        head_dim=d,
        num_hidden_layers=3,
        block_size=8,
        hidden_act="silu",
    )
    ref = MiniMaxLightningAttention(config, layer_idx=1).eval()
    gen = torch.Generator().manual_seed(length)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        x = torch.randn(2, length, heads * d, generator=gen)
        whole, whole_state = ref(x, None, None)
        cache, stepped = MiniMaxCache(), []
        cache.set_linear_cache(1, torch.zeros(2, heads, d, d))
        for t in range(length):
            out, step_state = ref(x[:, t : t + 1], None, None, cache=cache)
            stepped.append(out)
        qkv = (
            torch.nn.functional.silu(x @ ref.qkv_proj.weight.T)
            .view(2, length, heads, 3 * d)
            .transpose(1, 2)
        )
        q, k, v = qkv.split(d, -1)
        decay = -slopes(heads, 1, 3).view(1, heads, 1).expand(2, heads, length)
        for block in (1, 3, 8, 64):
            ours, state = lightning_scan(q, k, v, decay, torch.zeros(2, heads, d, d), block)
            y = ours.transpose(1, 2).reshape(2, length, -1)
            y = ref.norm(y) * torch.sigmoid(ref.output_gate(x))
            y = ref.out_proj(y)
            assert compare(y, whole)["max_relative_error"] < 1e-4, block
            assert compare(y, torch.cat(stepped, 1))["max_relative_error"] < 1e-4, block
            assert compare(state, whole_state)["max_relative_error"] < 1e-4, block
            assert compare(state, step_state)["max_relative_error"] < 1e-4, block


def test_a_long_prompt_read_in_chunks_equals_one_pass(loaded):
    check_chunks_equal_one_pass(
        loaded.model, random_ids(90, seed=3, batch=2), (17, 1, 40, 29, 1, 1, 1), 96, 1e-4
    )


def test_paged_chunks_continue_each_sequences_state_in_its_slot(loaded):
    """Two sequences through state slots: one read in uneven chunks beside the other's prompt and
    decoding; each step's last-token logits equal the whole read's at that position."""
    tokens = {"long": random_ids(60, seed=4)[0], "short": random_ids(12, seed=5)[0]}
    schedule = [
        [("long", 23), ("short", 9)],
        [("long", 20), ("short", 1)],
        [("short", 1), ("long", 17)],
        [("short", 1)],
    ]
    check_driver_slots(loaded.model, tokens, schedule)


def test_left_padding_leaves_the_state_of_a_fresh_sequence(loaded):
    assert check_left_padding(loaded.model).states


def test_tensor_parallel_ranks_hold_whole_heads_and_read_only_their_rows(tiny):
    cfg = from_hf(read_config(tiny))
    heads, d, hidden = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    attn = "model.layers.0.self_attn"
    shapes = {
        f"{attn}.qkv_proj.weight": (3 * heads * d, hidden),
        f"{attn}.output_gate.weight": (heads * d, hidden),
        f"{attn}.norm.weight": (heads * d,),
        f"{attn}.out_proj.weight": (hidden, heads * d),
    }
    for rank in range(2):
        decoder = meta_decoder(cfg, ParallelCtx(rank, 2))
        mixer = decoder.layers[0].token_mixer
        assert mixer.state_shapes() == ((2, d, d),)  # two of the four heads, a [d, d] state each
        assert mixer.slope == pytest.approx(
            slopes(heads, 0, cfg.num_layers)[2 * rank : 2 * rank + 2].tolist()
        )
        plan = build_plan(cfg.spec, cfg, decoder.shards(), shapes)
        reads = {
            read.source.rsplit(".", 2)[-2]: [(p.rows or p.cols).start for p in read.pieces]
            + [(p.rows or p.cols).stop for p in read.pieces]
            for read in plan.reads
            if read.source.startswith(attn)
        }
        # a head's query, key and value rows are contiguous in qkv_proj: two heads are one run of 6
        # d rows
        assert reads["qkv_proj"] == [rank * 6 * d, (rank + 1) * 6 * d]
        # the output gate's and the norm's rows, and out_proj's columns, of the rank's two heads
        assert (
            reads["output_gate"]
            == reads["norm"]
            == reads["out_proj"]
            == [rank * 2 * d, (rank + 1) * 2 * d]
        )


def test_more_ranks_than_heads_is_refused(tiny):
    cfg = from_hf(read_config(tiny))
    with pytest.raises(Refusal, match="4 heads, fewer than the 8 tensor-parallel ranks"):
        meta_decoder(cfg, ParallelCtx(0, 8))


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(block_size=0), "block_size is 0"),
        (
            dict(
                layer_types=[
                    "linear_attention",
                    "sliding_attention",
                    "linear_attention",
                    "linear_attention",
                ]
            ),
            "layer type 'sliding_attention' is not supported for MiniMax",
        ),
        (
            dict(shared_intermediate_size=16),
            "shared_intermediate_size is set; MiniMax's shared experts",
        ),
        (dict(sliding_window=4), "sliding_window is set"),
        (dict(mlp_beta_factor="one"), "mlp_beta_factor is 'one'"),
    ],
)
def test_configs_it_cannot_run_are_refused(tiny, tmp_path, changes, words):
    with pytest.raises(Refusal, match=words.replace("(", r"\(")):
        load_model(resolve(str(edited_copy(tiny, tmp_path, **changes))), "f32")


def test_without_layer_types_every_second_layer_is_lightning(tiny, tmp_path):
    cfg = from_hf(read_config(edited_copy(tiny, tmp_path, layer_types=None)))
    assert cfg.mixers == ("attention", "lightning", "attention", "lightning")
    assert cfg.residual_from_norm and cfg.residual_factors[1] == (1.3, 0.7, 1.1, 0.8)


@pytest.fixture(scope="module")
def text_01(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "minimax_text_01")[0]


def test_minimax_text_01_reads_attn_type_list_and_its_own_factors(text_01):
    cfg = from_hf(read_config(text_01))
    assert cfg.family == "minimax_text_01"
    assert cfg.mixers == ("attention", "lightning", "lightning", "attention")
    assert cfg.residual_factors[0] == (0.9, 1.2, 1.1, 0.8) and cfg.residual_from_norm


def test_minimax_text_01_rotates_its_stated_rotary_dim(text_01, tmp_path):
    """MiniMax-Text-01 rotates rotary_dim of each head (64 of 128 in the release), as its own code
    does."""
    cfg = from_hf(read_config(edited_copy(text_01, tmp_path, rotary_dim=8)))
    assert [rope.rotary_dim if rope else None for rope in cfg.layer_rope] == [8, None, None, 8]


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(attn_type_list=None), "neither attn_type_list nor layer_types is stated"),
        (
            dict(attn_type_list=[1, 0, 2, 1]),
            r"attn_type_list is \[1, 0, 2, 1\]; it must mark each layer 0",
        ),
    ],
)
def test_minimax_text_01_configs_it_cannot_run_are_refused(text_01, tmp_path, changes, words):
    with pytest.raises(Refusal, match=words):
        load_model(resolve(str(edited_copy(text_01, tmp_path, **changes))), "f32")


def test_without_postnorm_the_residual_is_the_sublayers_input(text_01, tmp_path):
    """MiniMax's own postnorm false: the residual is each sublayer's input, not its normed input."""
    normed = load_model(resolve(str(text_01)), "f32")
    plain = load_model(resolve(str(edited_copy(text_01, tmp_path, postnorm=False))), "f32")
    assert not plain.cfg.residual_from_norm
    ids = random_ids(6, seed=7)
    with torch.no_grad():
        assert compare(plain.model(ids), normed.model(ids))["max_relative_error"] > 1e-2


def test_the_token_engine_reads_prompts_in_chunks_beside_decodes_as_each_alone(tiny, loaded):
    """A continuous batch on MiniMax (lightning state slots beside attention blocks), six tokens a
    step, equals each request's greedy tokens alone; prefix caching is off."""
    from tests.engine.test_recurrent_engine import alone, open_engine, prompts, run_all

    ps = prompts(4, seed=8, lo=3, hi=25)
    lengths = [6, 3, 8, 5]
    with open_engine(tiny, max_step_tokens=6) as engine:
        got = run_all(engine, ps, lengths)
        stats = engine.stats()
    assert stats["prefix_caching"] is False and stats["state_slots"] > 0
    for p, n, tokens in zip(ps, lengths, got):
        assert tokens == alone(loaded.model, p, n)
