"""Tensor parallelism on real gloo process groups: every family at TP=2 equals TP=1 and
Transformers; the loader reads only each rank's share and stays within its memory bound;
failures surface as one error and leave no processes behind."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from ster_dist.errors import Refusal, WorkerLost
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import engine_tokens
from tests.tiny_models import TINY, make_tiny

VARIANTS = sorted(TINY)


@pytest.fixture(scope="module")
def group():
    with SpawnGroup(2) as g:
        yield g


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {v: tmp_path_factory.mktemp(v) for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_logits_and_greedy_tokens_equal_tp1_and_transformers(group, tiny_dirs, variant):
    reference = make_tiny(variant, tiny_dirs[variant])
    checkpoint = resolve(str(tiny_dirs[variant]))
    single = load_model(checkpoint, "f32")
    group.call("load", checkpoint, "f32", "cpu")
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    tp2 = group.call("logits", ids)[0]
    with torch.no_grad():
        tp1 = single.model(ids)
        theirs = reference(ids).logits
    assert compare(tp2, tp1)["max_relative_error"] < 1e-5
    assert compare(tp2, theirs)["max_relative_error"] < 1e-4
    prompts = [ids[0, :7].tolist(), ids[1, :4].tolist()]
    eos = single.cfg.eos_token_ids
    assert engine_tokens(group, prompts, 10, eos, checkpoint) == engine_tokens(
        single, prompts, 10, eos
    )


@pytest.mark.parametrize(
    "heads, kv, tp, expected",
    [
        (9, 3, 2, [((0, 3), (0, 1)), ((3, 9), (1, 3))]),  # SmolLM2: balanced, not refused
        (4, 1, 2, [((0, 2), (0, 1)), ((2, 4), (0, 1))]),  # one key-value head, replicated
        (8, 2, 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),
        (8, 8, 2, [((0, 4), (0, 4)), ((4, 8), (4, 8))]),
    ],
)
def test_attention_heads_keep_each_query_head_with_its_key_value_head(heads, kv, tp, expected):
    from ster_dist.parallel.ctx import ParallelCtx

    assert [ParallelCtx(r, tp).attention_heads(heads, kv) for r in range(tp)] == expected


def _big_llama(directory, hidden=1024, layers=6, vocab=32001):
    """A checkpoint of a few hundred MB written without Transformers (random f32 tensors)."""
    import json

    inner, heads, kv = 2816, 16, 8
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inner,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen),
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen),
        "model.norm.weight": torch.ones(hidden),
    }
    d = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (heads * d, hidden),
            "self_attn.k_proj": (kv * d, hidden),
            "self_attn.v_proj": (kv * d, hidden),
            "self_attn.o_proj": (hidden, heads * d),
            "mlp.gate_proj": (inner, hidden),
            "mlp.up_proj": (inner, hidden),
            "mlp.down_proj": (hidden, inner),
        }
        for name, shape in shapes.items():
            tensors[f"{p}{name}.weight"] = torch.randn(shape, generator=gen) * 0.02
        tensors[f"{p}input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{p}post_attention_layernorm.weight"] = torch.ones(hidden)
    half = len(tensors) // 2
    names = sorted(tensors)
    save_file(
        {n: tensors[n] for n in names[:half]}, str(directory / "model-00001-of-00002.safetensors")
    )
    save_file(
        {n: tensors[n] for n in names[half:]}, str(directory / "model-00002-of-00002.safetensors")
    )
    (directory / "config.json").write_text(json.dumps(cfg))
    from tests.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(directory)
    total = sum(t.numel() * 4 for t in tensors.values())
    replicated = sum(t.numel() * 4 for t in tensors.values() if t.dim() == 1)
    return total, replicated


def test_each_rank_reads_its_share_within_the_memory_bound(tmp_path):
    total, replicated = _big_llama(tmp_path)
    assert total > 300e6
    checkpoint = resolve(str(tmp_path))
    with SpawnGroup(2) as g:
        stats = g.call("load", checkpoint, "f32", "cpu")
    # every byte is read by exactly one rank, except the replicated norms, read by both
    assert sum(s["bytes_read"] for s in stats) == total + replicated
    for s in stats:
        assert math.isclose(s["bytes_read"], (total + replicated) / 2, rel_tol=0.01)
        growth = s["peak_rss_after"] - s["peak_rss_before"]
        assert growth < 0.6 * total, (
            f"rank {s['rank']} grew by {growth / total:.2f}x the checkpoint"
        )


def test_a_refusal_inside_the_ranks_surfaces_once():
    with pytest.raises(Refusal, match="2 key-value heads cannot be replicated evenly over 3 ranks"):
        with SpawnGroup(3) as g:
            g.call("load", resolve(str(_tiny("llama"))), "f32", "cpu")


def _tiny(variant):
    import tempfile
    from pathlib import Path

    directory = Path(tempfile.mkdtemp())
    make_tiny(variant, directory)
    return directory


def test_a_killed_rank_is_one_error_and_no_process_is_left():
    import os
    import signal

    g = SpawnGroup(2)
    procs = list(g.procs)
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(timeout=10)
    with pytest.raises(WorkerLost, match=r"rank 1 died"):
        g.call("ctx")
    for proc in procs:
        proc.join(timeout=10)
        assert not proc.is_alive()
