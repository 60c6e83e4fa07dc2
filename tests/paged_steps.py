"""Paged steps as the tests drive them: a plain block driver that hands out scattered blocks as
sequences grow, one step of chunks through Decoder.forward_paged, and the same as a rank extension,
so tensor-parallel ranks run a schedule on their own caches."""

from __future__ import annotations

import random

import torch

from ster_dist.model.paged import Chunk, PagedCache
from ster_dist.workers.extension import RankExtension

BLOCK = 4


class Driver:
    """The driver's share, as plainly as the tests need it: blocks from a shuffled free list, so no
    sequence's blocks are contiguous or in order, and a recurrent-state slot per sequence (in the
    order sequences first appear; a cache of a model with recurrent layers needs as many
    state_slots)."""

    def __init__(self, cache: PagedCache, seed: int = 0):
        self.cache = cache
        self.free = list(range(1, cache.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.length: dict[str, int] = {}
        self.slots: dict[str, int] = {}

    def chunk(self, name: str, length: int) -> Chunk:
        start = self.length.get(name, 0)
        blocks = self.blocks.setdefault(name, [])
        while len(blocks) * self.cache.block_size < start + length:
            blocks.append(self.free.pop())
        self.length[name] = start + length
        return Chunk(tuple(blocks), start, length, self.slots.setdefault(name, len(self.slots)))


def run_step(model, driver: Driver, tokens: dict[str, torch.Tensor], step, release=None):
    """(chunks, logits [chunks, vocab]) of one step [(sequence, new tokens), ...]; `release` may
    rewrite each chunk's blocks (a sliding window's released ones) before the forward."""
    chunks = [driver.chunk(name, n) for name, n in step]
    if release is not None:
        chunks = [release(c) for c in chunks]
    ids = torch.cat(
        [tokens[name][c.start : c.start + c.length] for (name, _), c in zip(step, chunks)]
    )
    with torch.inference_mode():
        return chunks, model.forward_paged(ids, chunks, driver.cache)


class PagedOnRank(RankExtension):
    def run(self, tokens: dict[str, torch.Tensor], schedule, num_blocks: int) -> dict | None:
        """Every step's logits and the shape of this rank's layer-0 keys, on its own cache."""
        driver = Driver(PagedCache(self.model, num_blocks, BLOCK))
        logits = [run_step(self.model, driver, tokens, step)[1] for step in schedule]
        return {
            "logits": self.first_rank_only(logits),
            "key_shape": tuple(driver.cache.keys[0].shape),
        }


def random_sequences(seed: int, length: int = 30, names: str = "ABC") -> dict[str, torch.Tensor]:
    """A sequence of `length` token ids (in the tiny tokenizer's range, past its special tokens) per
    name."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randint(3, 300, (length,), generator=gen) for name in names}


def check_paged_equals_whole(
    model, tokens: dict[str, torch.Tensor], schedule, num_blocks: int = 40, state_slots: int = 0
) -> Driver:
    """Run `schedule` through a paged cache of `model`: each chunk's last logits must equal the
    whole read's at that position (a causal read: position p's logits are those of the first p + 1
    tokens read whole).
    `state_slots`: a recurrent state per sequence, for a model with recurrent layers. Returns the
    driver, for what a test checks after."""
    from ster_dist.parity import compare

    with torch.no_grad():
        whole = {name: model(t[None])[0] for name, t in tokens.items()}
    driver = Driver(PagedCache(model, num_blocks, BLOCK, state_slots=state_slots))
    for step in schedule:
        chunks, logits = run_step(model, driver, tokens, step)
        for row, ((name, _), c) in enumerate(zip(step, chunks)):
            error = compare(logits[row], whole[name][c.start + c.length - 1])["max_relative_error"]
            assert error < 1e-5, (step, name, error)
    return driver


def check_ranks_equal_one(
    group, directory, model, tokens: dict[str, torch.Tensor], schedule, num_blocks: int = 40
) -> tuple[list[dict], Driver]:
    """`schedule` on every rank of `group` (the checkpoint at `directory` loaded there), each over
    its own paged cache, gives the logits one rank's `model` gives. Returns (each rank's run, the
    single rank's driver)."""
    from ster_dist.parity import compare
    from ster_dist.resolve import resolve

    group.call("load", resolve(str(directory)), "f32", "cpu")
    ranks = group.on(PagedOnRank).run(tokens, schedule, num_blocks)
    single = Driver(PagedCache(model, num_blocks, BLOCK))
    for step, logits in zip(schedule, ranks[group.lead]["logits"]):
        error = compare(logits, run_step(model, single, tokens, step)[1])["max_relative_error"]
        assert error < 1e-5, (step, error)
    return ranks, single
