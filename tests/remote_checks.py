"""Checks the families tested against a hand-made reference share
(tests/families/test_telechat_mimo_pangu_nanbeige.py, test_plamo3.py, test_chatglm.py): random ids,
greedy decoding by whole re-reads of a reference forward, decoding from the paged cache equal to the
whole read, batches in the token engine equal to one at a time, and TP=2 equal to TP=1 (or EP=2
equal to one rank) on a spawned gloo group."""

from __future__ import annotations

import torch

from ster_dist.model.paged import PagedCache

from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import engine_tokens
from tests.paged_steps import check_paged_equals_whole


def random_ids(
    batch: int, length: int, seed: int = 0, low: int = 3, high: int = 300
) -> torch.Tensor:
    return torch.randint(low, high, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy_by_rereading(forward, prompt: list[int], n: int, eos: int) -> list[int]:
    """Greedy tokens of a reference forward over ids (logits [1, t, vocab]), reading the whole text
    each step."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            token = int(forward(torch.tensor([ids]))[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


def check_cache_and_batches(loaded, what: str = "") -> None:
    """A prompt read into the paged cache, then one token at a time, equals the whole read; prompts
    of different lengths batched in the token engine generate what each does alone."""
    ids = random_ids(2, 20, seed=2)
    # a model that carries state across steps (recurrent layers, an n-gram embedding's last tokens)
    # keeps one
    # state slot per sequence beside its blocks
    slots = 2 if PagedCache.state_bytes(loaded.model) else 0
    check_paged_equals_whole(
        loaded.model,
        {"A": ids[0], "B": ids[1]},
        [[("A", 12), ("B", 12)]] + [[("A", 1), ("B", 1)]] * 8,
        state_slots=slots,
    )
    prompts = [random_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 9, 6)]
    eos = loaded.cfg.eos_token_ids
    assert engine_tokens(loaded, prompts, 8, eos) == [
        engine_tokens(loaded, [p], 8, eos)[0] for p in prompts
    ], what


def check_tp2_equals_tp1(checkpoints: dict) -> None:
    """Each (directory, loaded one-rank model) of `checkpoints` on one spawned group of two ranks:
    logits and greedy tokens equal the one-rank model's."""
    with SpawnGroup(2) as group:
        check_group_equals_one_rank(group, checkpoints)


def check_group_equals_one_rank(group, checkpoints: dict) -> None:
    """Each (directory, loaded one-rank model) of `checkpoints` loaded on a spawned group (tensor-
    or expert-parallel): logits and greedy tokens equal the one-rank model's."""
    ids = random_ids(2, 24, seed=4)
    prompts = [ids[0, :7].tolist(), ids[1, :4].tolist()]
    for name, (directory, single) in checkpoints.items():
        checkpoint = resolve(str(directory))
        group.call("load", checkpoint, "f32", "cpu")
        with torch.no_grad():
            one = single.model(ids)
        assert compare(group.call("logits", ids)[0], one)["max_relative_error"] < 1e-5, name
        eos = single.cfg.eos_token_ids
        assert engine_tokens(group, prompts, 8, eos, checkpoint) == engine_tokens(
            single, prompts, 8, eos
        ), name
