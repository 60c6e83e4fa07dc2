"""What the driver sends the ranks each step, and what rank 0 sends back: plain data, pickled by Ray
(or passed as is in one process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ster_dist.engine.sampling import SamplingParams


@dataclass(frozen=True)
class NewSequence:
    """A sequence the ranks have not seen: rank 0's sampler keeps its generator and penalty
    counts."""

    id: str
    params: SamplingParams
    prompt: list[int]


@dataclass
class StepWork:
    """One forward: the new tokens of every scheduled chunk, packed in chunk order.

    chunks[i] = (block table covering the chunk's last position, start, length, the sequence's
    recurrent-state slot or -1 when the model keeps none, the prompt length a prefix LM's chunk from
    position 0 reads both ways or 0); `samples` names the chunks whose last token's logits choose
    their sequence's next token. Steering and adapters are per chunk, by the key they were
    registered under."""

    ids: list[int]
    chunks: list[tuple[tuple[int, ...], int, int, int, int]]
    samples: list[tuple[int, str]]  # (chunk index, sequence id)
    added: list[NewSequence] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # (chunk index, vector key, strength)
    steering: list[tuple[int, str, float]] = field(default_factory=list)
    # (chunk index, adapter name)
    adapters: list[tuple[int, str]] = field(default_factory=list)
    # speculative decoding (engine/drafter.py): every chunk's sequence id (None where the sequence
    # never drafts:
    # no MTP rows kept for it), and (chunk index, most drafts) for each one-token decode the ranks
    # may extend
    # with drafts; its table covers them
    seq_ids: list[str | None] = field(default_factory=list)
    drafts: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    """Rank 0's choices, one per sampling chunk in `StepWork.samples` order."""

    tokens: list[int]
    logprobs: list  # per sample: None, or (chosen id, its logprob, [(id, logprob), ...])
    # sample index -> raw logits of its request's `logits_of` ids; only samples that asked (so a
    # step of plain requests sends nothing more back)
    scores: dict[int, list[float]] = field(default_factory=dict)
    # speculative decoding, by sample index: the drafts the ranks proposed, and those verified
    # (`tokens` then
    # holds the token after them)
    drafted: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, list[int]] = field(default_factory=dict)
