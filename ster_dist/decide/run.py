"""Answering a decide request through the token engine (engine/loop.py).

Every question in every order is rendered and tokenized first. Each rendering is then one engine
request: its whole tokens, one greedy token (the answer itself is never used), and the raw logits
of every spelling of its option letters at its last position (SamplingParams.logits_of), which
rank 0 sends back beside the token. The renderings all begin with the header and the state, so the
prefix cache serves those blocks: the first rendering is read alone, and the rest are submitted
only once it is done, since requests admitted in the same step would all miss the blocks none of
them has computed yet. Each later rendering then computes only what follows the cached blocks.
The driver reduces each row to its letters' logits (log-sum-exp over the spellings of each letter).
"""

from __future__ import annotations

import torch

from ster_dist.decide import answer as arithmetic
from ster_dist.decide.prompt import LABELS, orders, render
from ster_dist.decide.request import Request
from ster_dist.engine.sampling import SamplingParams
from ster_dist.errors import Refusal
from ster_dist.steer.text import encode_prompt


def label_tokens(tokenizer, label: str) -> list[int]:
    """Every id the vocabulary spells `label` with as one token: bare, SentencePiece's "▁A" and
    byte-level BPE's "ĠA" (which one carries the mass depends on what the prompt ended with)."""
    ids = []
    for spelling in (label, f"\u2581{label}", f"\u0120{label}"):
        token = tokenizer.token_to_id(spelling)
        if token is not None and token not in ids:
            ids.append(token)
    if not ids:
        raise Refusal(
            f'this tokenizer has no single token for the answer label "{label}", so it cannot be read '
            "from one position"
        )
    return ids


def shared_prefix(rows: list[list[int]]) -> int:
    first = rows[0]
    common = len(first)
    for row in rows[1:]:
        n = 0
        for a, b in zip(row, first):
            if a != b:
                break
            n += 1
        common = min(common, n)
    return min(common, min(len(r) for r in rows) - 1)


def _letters(scores: list[float], label_ids: list[list[int]]) -> list[float]:
    """Per answer position, the log-sum-exp of its spellings' logits (scores in logits_of order:
    every spelling of position 0, then of position 1, ...)."""
    out, at = [], 0
    for ids in label_ids:
        out.append(
            float(torch.logsumexp(torch.tensor(scores[at : at + len(ids)], dtype=torch.float64), 0))
        )
        at += len(ids)
    return out


def read(
    engine, rows: list[list[int]], labels: list[list[list[int]]], adapter: str | None = None
) -> list:
    """Each row's letter logits and the engine's Finished for it: the first row alone, then the
    rest."""

    def submit(row, label_ids):
        params = SamplingParams(
            max_tokens=1, ignore_eos=True, logits_of=tuple(i for ids in label_ids for i in ids)
        )
        return engine.submit(row, params, adapter=adapter)

    streams = []
    try:
        streams.append(submit(rows[0], labels[0]))
        done = [streams[0].result()]  # its full blocks are in the prefix cache once it is done
        streams.extend(submit(row, label_ids) for row, label_ids in zip(rows[1:], labels[1:]))
        done.extend(stream.result() for stream in streams[1:])
    except BaseException:  # a failure or an interrupt frees what is still in flight
        for stream in streams:
            stream.cancel()
        raise
    out = []
    for finished, label_ids in zip(done, labels):
        if not finished.scores or finished.scores[0] is None:
            raise Refusal(
                f"the engine ended a decide reading with {finished.finish_reason!r} before its letters "
                "were read"
            )
        out.append((_letters(finished.scores[0], label_ids), finished))
    return out


def read_questions(
    engine,
    tokenizer,
    cfg,
    request: Request,
    permutations: int,
    chat_template: str,
    progress,
    adapter: str | None = None,
) -> tuple[list[tuple[list, list]], dict]:
    """Per question (in request order): its rows (letter logits in canonical option order, one per
    order) and those orders; and the usage. What decide answers from and calibrate fits on."""
    if permutations < 0:
        raise Refusal(f"--permutations must be 0 (every order) or more, got {permutations}")
    rows, owners, row_orders, labels = [], [], [], []
    spellings: dict[int, list[int]] = {}
    for index, question in enumerate(request.questions):
        options = question.options()
        for position in range(len(options)):
            if position not in spellings:
                spellings[position] = label_tokens(tokenizer, LABELS[position])
        for order in orders(len(options), permutations):
            ids = encode_prompt(tokenizer, render(request, question, options, order), chat_template)
            if len(ids) + 1 > cfg.max_position:  # the letter is read as the next position's token
                raise Refusal(
                    f"question '{question.id}' renders to {len(ids)} tokens, past the {cfg.max_position} "
                    "this model was built for once the answer's position is counted; shorten the state "
                    "or the question"
                )
            rows.append(ids)
            owners.append(index)
            row_orders.append(order)
            labels.append([spellings[p] for p in range(len(options))])
    shared = shared_prefix(rows)
    between = sum(len(r) - shared for r in rows)
    progress(
        f"reading the state once ({shared} tokens; the prefix cache serves it after), then {len(rows)} "
        f"question renderings ({between} tokens between them)"
    )
    readings = read(engine, rows, labels, adapter)
    per_question: list[tuple[list, list]] = [([], []) for _ in request.questions]
    for owner, order, (row, _) in zip(owners, row_orders, readings):
        canonical = [0.0] * len(order)
        for position, option in enumerate(order):
            canonical[option] = row[position]
        per_question[owner][0].append(canonical)
        per_question[owner][1].append(order)
    # input_tokens: prompt tokens the model computed (the prefix cache's hits are not); one forward
    # pass per rendering (the step it shares with others counts once for each)
    computed = sum(f.prompt_tokens - f.cached_tokens for _, f in readings)
    return per_question, {"input_tokens": computed, "forward_passes": len(rows), "output_tokens": 0}


def decide(
    engine,
    tokenizer,
    cfg,
    request: Request,
    permutations: int,
    chat_template: str,
    explain: bool,
    progress,
    adapter: str | None = None,
    temperature: float = 1.0,
) -> dict:
    """answers, explain (optional) and usage for `request`, read through `engine` (a TokenEngine);
    `adapter` names one registered with it (engine.add_adapter); `temperature` divides the logits
    (a calibration's; explain's per-order probabilities stay raw)."""
    per_question, usage = read_questions(
        engine, tokenizer, cfg, request, permutations, chat_template, progress, adapter
    )
    answers, explained = {}, {}
    for question, (question_rows, question_orders) in zip(request.questions, per_question):
        answers[question.id] = arithmetic.answer(
            question, arithmetic.probabilities(question_rows, temperature)
        )
        if explain:
            explained[question.id] = arithmetic.explanation(
                question, question_rows, question_orders
            )
    out = {"answers": answers}
    if explain:
        out["explain"] = explained
    out["usage"] = usage
    return out
