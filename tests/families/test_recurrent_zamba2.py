"""Zamba2's hybrid layer kind (a shared transformer block, then Mamba-2) beyond
tests/families/test_parity.py: a long prompt read in chunks (static cache, and paged steps with a
state slot per sequence) equals one pass and Transformers, and so does the token engine's continuous
batch; a block several layers share is one tensor on every rank, read once even where the checkpoint
stores every copy; TP=2 equals one rank; bad config values are refused in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.config import from_hf
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.recurrent_checks import (
    PagedStatesOnRank,
    check_long_prompt_in_chunks,
    check_paged_steps,
    one_line_refusal,
    paged_tokens,
    random_ids,
    run_paged,
    variants_fixture,
)
from tests.engine.test_recurrent_engine import alone, open_engine, prompts, run_all

# "zamba2": untied head, so Transformers ties no block (each hybrid layer its own); "zamba2_plain":
# tied blocks
VARIANTS = ["zamba2", "zamba2_plain"]


tiny = variants_fixture(VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_prompt_in_chunks_equals_one_pass_and_transformers(tiny, variant):
    reference, model = tiny[variant][:2]
    check_long_prompt_in_chunks(model, reference)


@pytest.mark.parametrize(
    "variant", [pytest.param("zamba2", marks=pytest.mark.slow), "zamba2_plain"]
)
def test_paged_steps_carry_each_sequences_state_and_keys(tiny, variant):
    """Prefill chunks of two sequences, packed with each other's decodes, equal whole reads: each
    hybrid layer keeps its keys in the paged cache and its Mamba-2 state in the sequence's slot."""
    check_paged_steps(tiny[variant][1], paged_tokens(), variant)


def test_the_token_engine_reads_prompts_in_chunks_beside_decodes_as_each_alone(tiny):
    """Continuous batching with chunked prefill: each hybrid layer's keys in blocks and its state in
    the request's slot; prefix caching off."""
    directory, reference = tiny["zamba2_plain"][3], tiny["zamba2_plain"][1]
    ps = prompts(4, seed=1, lo=3, hi=30)
    lengths = [9, 4, 12, 7]
    with open_engine(directory, max_step_tokens=6) as engine:
        got = run_all(engine, ps, lengths)
        stats = engine.stats()
    for p, n, tokens in zip(ps, lengths, got):
        assert tokens == alone(reference, p, n)
    assert (
        stats["prefix_caching"] is False
        and stats["state_bytes"] > 0
        and stats["kv_blocks"]["used"] == 0
    )


def test_tied_blocks_are_one_tensor_and_untied_ones_their_own(tiny):
    tied, untied = tiny["zamba2_plain"][1], tiny["zamba2"][1]
    # hybrid layers 0 and 2: block 0
    first, third = tied.layers[1].mixer.shared, tied.layers[4].mixer.shared
    assert (
        first.attn.q.weight is third.attn.q.weight
        and first.mlp.down.weight is third.mlp.down.weight
    )
    assert first.gate_up_adapters["2"].b is third.gate_up_adapters["2"].b
    assert tied.layers[3].mixer.shared.attn.q.weight is not first.attn.q.weight  # block 1
    assert (
        untied.layers[4].mixer.shared.attn.q.weight
        is not untied.layers[1].mixer.shared.attn.q.weight
    )
    every_copy = sum(
        p.numel() for p in dict(tied.named_parameters(remove_duplicate=False)).values()
    )
    assert every_copy - sum(p.numel() for p in tied.parameters()) == sum(
        p.numel() for p in third.parameters()
    )


def test_a_checkpoint_storing_every_tied_copy_is_read_once(tiny, tmp_path):
    """Some checkpoints store each hybrid layer's copy of its block: the copies are skipped, not
    refused."""
    directory = tiny["zamba2_plain"][3]
    for item in directory.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(directory / "model.safetensors")
    first = "model.layers.1.shared_transformer."
    tensors.update(
        {
            name.replace(first, "model.layers.4.shared_transformer."): t.clone()
            for name, t in tensors.items()
            if name.startswith(first)
        }
    )
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(resolve(str(tmp_path)), "f32")
    ids = random_ids(20)
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), tiny["zamba2_plain"][1](ids))


@pytest.mark.slow
def test_tensor_parallel_paged_steps_agree_with_one_rank(tiny):
    """Paged steps at TP=2 equal one rank's (tests/parallel/test_tensor_parallel.py compares whole
    reads and greedy)."""
    tokens = paged_tokens()
    with SpawnGroup(2) as group:
        for variant in VARIANTS:
            group.call("load", resolve(str(tiny[variant][3])), "f32", "cpu")
            ranks = group.on(PagedStatesOnRank).run(tokens)
            _, single, _ = run_paged(tiny[variant][1], tokens)
            for tp2, tp1 in zip(ranks[0]["logits"], single):
                assert compare(tp2, tp1)["max_relative_error"] < 1e-5, variant


def test_each_rank_holds_its_share_of_a_hybrid_layer(tiny):
    """Half the attention and Mamba-2 heads, its rows of each adapter's B; A and the layer's linear
    whole."""
    cfg = from_hf(tiny["zamba2"][2])
    for rank in range(2):
        mixer = meta_decoder(cfg, ParallelCtx(rank, 2)).layers[1].mixer
        shared = mixer.shared
        assert mixer.kv_shape == ((2, 24), (2, 24)) and mixer.state_shapes() == (
            (48 + 32, 3),
            (2, 24, 16),
        )
        assert tuple(shared.attn.q.weight.shape) == (48, 96) and tuple(
            shared.q_adapters["0"].b.shape
        ) == (48, 6)
        assert tuple(shared.q_adapters["0"].a.shape) == (6, 96)
        assert tuple(shared.gate_up_adapters["0"].b.shape) == (56, 6) and tuple(
            mixer.linear.weight.shape
        ) == (48, 48)


@pytest.mark.parametrize(
    "variant, change, words",
    [
        ("zamba2", {"num_key_value_heads": 2}, "use_shared_attention_adapter"),
        ("zamba2", {"layers_block_type": ["mamba", "attention"]}, "layers_block_type"),
        ("zamba2", {"num_mem_blocks": 0}, "num_mem_blocks"),
        ("zamba2", {"adapter_rank": None}, "adapter_rank"),
        ("zamba2", {"use_long_context": True}, "use_long_context"),
        ("zamba2", {"use_shared_mlp_adapter": False}, "use_shared_mlp_adapter"),
        ("zamba2_plain", {"n_mamba_heads": 3}, "n_groups"),
    ],
)
def test_bad_config_values_are_refused(tiny, variant, change, words):
    assert words in one_line_refusal({**tiny[variant][2], **change})
