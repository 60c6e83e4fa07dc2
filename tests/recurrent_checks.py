"""Checks the recurrent-layer test files share: tiny checkpoints made and loaded, random token ids,
a long prompt read in chunks against one pass, left padding against the unpadded read, paged steps
through state slots (the Driver's two-sequence schedule, and the Mamba-2 family's SCHEDULE, also as
a rank extension for tensor-parallel runs), copies of a checkpoint with edited config values, and
one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.model.paged import Chunk, PagedCache
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.workers.extension import RankExtension
from tests.paged_steps import Driver
from tests.tiny_models import make_tiny, read_config


def random_ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def make_checkpoint(tmp_path_factory, variant: str):
    """(directory, Transformers' reference model) of a tiny `variant` checkpoint."""
    directory = tmp_path_factory.mktemp(variant)
    return directory, make_tiny(variant, directory)


def checkpoint_fixtures(variant: str):
    """Module-scoped fixtures (tiny, loaded): a tiny `variant` checkpoint's directory and it loaded
    in f32; a test file takes them as `tiny, loaded = checkpoint_fixtures(...)`."""

    @pytest.fixture(scope="module")
    def tiny(tmp_path_factory):
        return make_checkpoint(tmp_path_factory, variant)[0]

    @pytest.fixture(scope="module")
    def loaded(tiny):
        return load_model(resolve(str(tiny)), "f32")

    return tiny, loaded


def variants_fixture(variants: list[str]):
    """A module-scoped fixture `tiny`: load_variants of `variants`; a test file takes it as
    `tiny = variants_fixture(VARIANTS)`."""

    @pytest.fixture(scope="module")
    def tiny(tmp_path_factory):
        return load_variants(tmp_path_factory, variants)

    return tiny


def load_variants(tmp_path_factory, variants: list[str]) -> dict:
    """variant -> (Transformers' model, ours loaded in f32, raw config, directory)."""
    made = {}
    for variant in variants:
        directory, reference = make_checkpoint(tmp_path_factory, variant)
        raw = json.loads((directory / "config.json").read_text())
        made[variant] = (
            reference,
            load_model(resolve(str(directory)), "f32").model,
            raw,
            directory,
        )
    return made


def check_chunks_equal_one_pass(
    model, ids: torch.Tensor, sizes, cache_length: int, tolerance: float, reference=None
):
    """Reads ids whole (equal to Transformers' `reference` when given), then in chunks of `sizes`
    through one static cache, and asserts the chunks' logits equal the whole read's; the cache, for
    further checks."""
    with torch.no_grad():
        whole = model(ids)
        if reference is not None:
            assert compare(whole, reference(ids).logits)["max_relative_error"] < 1e-4
        cache = model.new_cache(ids.shape[0], cache_length)
        parts, start = [], 0
        for size in sizes:
            parts.append(model(ids[:, start : start + size], cache=cache))
            start += size
    assert start == ids.shape[1]
    assert compare(torch.cat(parts, dim=1), whole)["max_relative_error"] < tolerance
    return cache


# crosses the Mamba-2 scan's 64-token chunks twice and Transformers' 16-token ones many times
LONG = 150


def check_long_prompt_in_chunks(model, reference):
    """LONG tokens in uneven chunks (one of them a single token) equal one pass, and that equals
    Transformers'; the cache."""
    return check_chunks_equal_one_pass(
        model, random_ids(LONG, batch=2), (37, 64, 1, 30, 18), LONG + 1, 1e-5, reference
    )


def check_left_padding(model):
    """A fresh sequence behind four pad tokens reads as it does alone, and leaves every layer the
    same state; the unpadded read's cache, for the caller's further checks."""
    ids = random_ids(9, seed=6)
    padded = torch.cat([torch.zeros(1, 4, dtype=ids.dtype), ids], dim=1)
    valid = torch.cat(
        [torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 9, dtype=torch.bool)], dim=1
    )
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        alone_cache, padded_cache = model.new_cache(1, 16), model.new_cache(1, 16)
        alone = model(ids, cache=alone_cache)
        ours = model(padded, positions=positions, valid=valid, cache=padded_cache)
    assert compare(ours[:, 4:], alone)["max_relative_error"] < 1e-4
    for layer, state in alone_cache.states.items():
        for mine, theirs in zip(padded_cache.states[layer], state):
            assert compare(mine, theirs)["max_relative_error"] < 1e-4, layer
    return alone_cache


def check_driver_slots(model, tokens: dict[str, torch.Tensor], schedule):
    """Sequences "long" and "short" in state slots 1 and 0, read through `schedule` [[(name, new
    tokens), ...]]: each step's last-token logits equal the whole read's at that position."""
    slots = {"long": 1, "short": 0}
    driver = Driver(PagedCache(model, 64, 4, state_slots=2))
    with torch.no_grad():
        whole = {name: model(ids.unsqueeze(0))[0] for name, ids in tokens.items()}
        for step in schedule:
            chunks = [
                dataclasses.replace(driver.chunk(name, size), state=slots[name])
                for name, size in step
            ]
            ids = torch.cat(
                [tokens[name][c.start : c.start + c.length] for (name, _), c in zip(step, chunks)]
            )
            logits = model.forward_paged(ids, chunks, driver.cache)
            for (name, _), chunk, row in zip(step, chunks, logits):
                expected = whole[name][chunk.start + chunk.length - 1]
                assert compare(row, expected)["max_relative_error"] < 1e-4, (name, chunk)


# (sequence, new tokens) per step: prefills longer than the Mamba-2 scan's chunk, packed with the
# other's decodes
SCHEDULE = [[("A", 70)], [("B", 33), ("A", 1)], [("A", 1), ("B", 40)], [("B", 1), ("A", 1)]]
SLOTS = {"A": 2, "B": 0}


def paged_tokens() -> dict[str, torch.Tensor]:
    return {"A": random_ids(80, seed=1)[0], "B": random_ids(80, seed=2)[0]}


def run_paged(
    model, tokens: dict[str, torch.Tensor]
) -> tuple[list[list[Chunk]], list[torch.Tensor], PagedCache]:
    """SCHEDULE through forward_paged, each sequence in its SLOTS state slot: (chunks, logits) per
    step."""
    cache = PagedCache(model, num_blocks=64, block_size=4, state_slots=3)
    free = list(range(1, 64))
    blocks: dict[str, list[int]] = {"A": [], "B": []}
    length = {"A": 0, "B": 0}
    all_chunks, all_logits = [], []
    for step in SCHEDULE:
        chunks = []
        for name, n in step:
            while len(blocks[name]) * 4 < length[name] + n:
                blocks[name].append(free.pop())
            chunks.append(Chunk(tuple(blocks[name]), length[name], n, state=SLOTS[name]))
            length[name] += n
        ids = torch.cat(
            [tokens[name][c.start : c.start + c.length] for (name, _), c in zip(step, chunks)]
        )
        with torch.no_grad():
            all_logits.append(model.forward_paged(ids, chunks, cache))
        all_chunks.append(chunks)
    return all_chunks, all_logits, cache


def check_paged_steps(model, tokens: dict[str, torch.Tensor], label: str):
    """run_paged's last-token logits of every chunk equal a whole read up to it; the paged cache."""
    chunks, logits, cache = run_paged(model, tokens)
    for step, step_chunks, step_logits in zip(SCHEDULE, chunks, logits):
        for (name, _), c, got in zip(step, step_chunks, step_logits):
            with torch.no_grad():
                whole = model(tokens[name][None, : c.start + c.length])[0, -1]
            assert compare(got[None], whole[None])["max_relative_error"] < 1e-5, (label, name, c)
    return cache


class PagedStatesOnRank(RankExtension):
    def run(self, tokens: dict[str, torch.Tensor]) -> dict:
        """This rank's paged logits of SCHEDULE and the shapes of its first recurrent layer's state
        slots."""
        _, logits, cache = run_paged(self.model, tokens)
        first = min(cache.states)
        return {
            "logits": self.first_rank_only(logits),
            "state_shapes": [tuple(s.shape) for s in cache.states[first]],
        }


def edited_copy(directory, tmp_path, **changes):
    """A copy of the checkpoint in `directory` under tmp_path/edited, its config changed (None drops
    a key)."""
    edited = tmp_path / "edited"
    shutil.copytree(directory, edited)
    config = read_config(edited)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (edited / "config.json").write_text(json.dumps(config))
    return edited


def one_line_refusal(raw: dict, tp: int = 1) -> str:
    """The refusal building every rank's decoder of `raw` at `tp` raises, asserted to be one
    line."""
    with pytest.raises(Refusal) as caught:
        for rank in range(tp):
            meta_decoder(from_hf(raw), ParallelCtx(rank, tp))
    message = str(caught.value)
    assert "\n" not in message
    return message
