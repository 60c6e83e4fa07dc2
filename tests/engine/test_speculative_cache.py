"""The MTP layer's own paged cache after a prefix-cache hit and after a preemption
(engine/drafter.py, engine/scheduler.py): each first draft a sequence gets equals the one a cold
run's MTP layer makes at that position, computed here in one forward of the layer over the
sequence's final tokens (its attention reads every earlier position's MTP keys, so a stale entry
shows as another draft); a request after a prefix hit gets the same tokens, drafts and
drafted/accepted counts as the same request in a fresh engine; and a preempted sequence's drafts
after its recompute are a cold run's too."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.engine.drafter import MTPDrafter
from ster_dist.engine.sampling import SamplingParams
from ster_dist.load import load_model
from ster_dist.model.paged import Chunk
from ster_dist.parallel.ctx import SINGLE
from ster_dist.resolve import resolve
from ster_dist.load.mtp import load_mtp
from tests.engine.test_engine import open_engine, prompts
from tests.engine.test_speculative import with_mtp

BLOCK = 4  # open_engine's block size


def attentive(directory: Path) -> Path:
    """tests/engine/test_speculative.py's random MTP layer with its attention output made large, so
    that its drafts turn on the keys it reads: a stale MTP key shows as another draft."""
    with_mtp(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    name = f"model.layers.{layers}.self_attn.o_proj.weight"
    tensors[name] = tensors[name] * 40
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An MTP layer whose drafts turn on its cache, and one that echoes its input token (drafts
    accepted)."""
    return {
        "attentive": attentive(tmp_path_factory.mktemp("mtp_attentive")),
        "echo": with_mtp(tmp_path_factory.mktemp("mtp_echo"), echo=True),
    }


@pytest.fixture(scope="module")
def cold_drafts(checkpoints):
    """(kind, tokens, position, k) -> the k drafts a cold run makes at a decode of token `position`:
    the MTP rows of every earlier position over a fresh cache (the row at q reads the model's hidden
    state at q and token q + 1), the last one's argmax, then as engine/drafter.py chains them (the
    layer's output and the last draft as the next row)."""
    layers = {}

    def drafts(kind: str, tokens: list[int], position: int, k: int) -> list[int]:
        if kind not in layers:
            loaded = load_model(resolve(str(checkpoints[kind])), "f32")
            layers[kind] = loaded, load_mtp(loaded, SINGLE)
        loaded, draft = layers[kind]
        ids = torch.tensor(tokens[: position + 1])
        table = tuple(range(1, -(-(position + k) // BLOCK) + 1))
        cache = draft.new_cache(len(table) + 1, BLOCK)
        with torch.no_grad():
            hidden = loaded.model.final_hidden(
                ids[None], torch.ones(1, len(ids), dtype=torch.bool)
            )[0]
            out, logits = draft.forward_paged(
                loaded.model, hidden[:position], ids[1:], [Chunk(table, 0, position)], cache
            )
            made = [int(logits[0].argmax())]
            for j in range(1, k):
                out, logits = draft.forward_paged(
                    loaded.model,
                    out[-1:],
                    torch.tensor(made[-1:]),
                    [Chunk(table, position - 1 + j, 1)],
                    cache,
                )
                made.append(int(logits[0].argmax()))
        return made

    return drafts


@pytest.fixture
def proposed(monkeypatch):
    """seq id -> [(the decode's position, its drafts)], as the rank's drafter proposed them
    (recorded, not replaced)."""
    seen = defaultdict(list)
    real = MTPDrafter.propose

    def recording(self, seq_ids, chunks, firsts, wanted):
        out = real(self, seq_ids, chunks, firsts, wanted)
        for i, drafts in out.items():
            seen[seq_ids[i]].append((chunks[i].start, drafts))
        return out

    monkeypatch.setattr(MTPDrafter, "propose", recording)
    return seen


def assert_cold(proposals: list[tuple[int, list[int]]], drafts) -> None:
    """Each (position, drafts) proposed equals a cold run's drafts there; `drafts(position, k)`."""
    assert proposals
    assert proposals == [(position, drafts(position, len(made))) for position, made in proposals]


@pytest.mark.parametrize("kind, first_tokens", [("attentive", 1), ("attentive", 6), ("echo", 6)])
def test_a_request_after_a_prefix_hit_drafts_as_it_would_cold(
    checkpoints, cold_drafts, proposed, kind, first_tokens
):
    """A first request shares three blocks with the second; it stops after one token (its MTP keys
    never written: they wait for a next step) or after six (written, but the third block's last one
    read the first request's next token, not the second's)."""
    g = torch.Generator().manual_seed(16)  # a second request the model repeats itself in
    shared = torch.randint(3, 300, (3 * BLOCK,), generator=g).tolist()
    first = shared + torch.randint(3, 300, (5,), generator=g).tolist()
    second = shared + torch.randint(3, 300, (3,), generator=g).tolist()
    counted = ("drafted_tokens", "accepted_tokens", "rejected_tokens")

    def run_second(after_first: bool):
        with open_engine(checkpoints[kind], speculative_tokens=2) as engine:
            if after_first:
                engine.submit(
                    first, SamplingParams(max_tokens=first_tokens, ignore_eos=True), request_id="a"
                ).result()
            before = engine.stats()
            tokens = engine.submit(
                second, SamplingParams(max_tokens=10, ignore_eos=True), request_id="b"
            ).result()
            after = engine.stats()
        return (
            tokens.token_ids,
            {k: after[k] - before[k] for k in counted},
            after["kv_blocks"]["prefix_hits"],
        )

    cold, cold_counts, _ = run_second(False)
    cold_proposals = list(proposed.pop("b"))
    hit, hit_counts, hits = run_second(True)
    assert hits > 0 or first_tokens == 1  # a prefix whose MTP keys were never written is not shared
    assert hit == cold and hit_counts == cold_counts
    assert proposed["b"] == cold_proposals
    assert_cold(proposed["b"], lambda position, k: cold_drafts(kind, second + hit, position, k))
    if kind == "echo":
        assert hit_counts["accepted_tokens"] > 0


def test_drafts_after_a_preemption_are_a_cold_runs(checkpoints, cold_drafts, proposed):
    """Under a tiny block budget sequences are preempted and recomputed, their own full blocks
    served from the prefix cache; every draft they get, before and after, is the one a cold run
    makes there."""
    ps = prompts(6, seed=7, lo=8, hi=16)

    def tokens(drafts: int) -> tuple[list[list[int]], dict]:
        with open_engine(
            checkpoints["attentive"], max_blocks=16, speculative_tokens=drafts
        ) as engine:
            streams = [
                engine.submit(p, SamplingParams(max_tokens=20, ignore_eos=True), request_id=f"p{i}")
                for i, p in enumerate(ps)
            ]
            return [s.result().token_ids for s in streams], engine.stats()

    got, stats = tokens(2)
    assert stats["preemptions"] > 0 and stats["kv_blocks"]["prefix_hits"] > 0
    for i, (prompt, out) in enumerate(zip(ps, got)):
        tokens_i = prompt + out
        assert_cold(
            proposed[f"p{i}"],
            lambda position, k, t=tokens_i: cold_drafts("attentive", t, position, k),
        )
    assert got == tokens(0)[0]
