"""Answering a decide request on the ranks.

Every question in every order is rendered and tokenized first. The renderings all begin with the
header and the state, so the longest run of tokens they share (found on the tokens, not the text:
a tokenizer may merge across the point where two texts diverge; each rendering keeps at least its
last token) goes through the model once into the KV cache. The cache is then forked per batch of
renderings and each rendering runs only its own suffix, left-padded after the shared slots (padding
is masked and positions skip it), so every row ends at the same slot and only the last position's
logits are computed. Every rank runs the same steps (the logits are gathered on every rank); rank 0
reduces each row to its letters' logits (log-sum-exp over the spellings of each letter) and
returns only those.
"""

from __future__ import annotations

import torch

from ster_dist.decide import answer as arithmetic
from ster_dist.decide.prompt import LABELS, orders, render
from ster_dist.decide.request import Request
from ster_dist.errors import Refusal
from ster_dist.steer.text import encode_prompt
from ster_dist.workers.extension import RankExtension


def label_tokens(tokenizer, label: str) -> list[int]:
    """Every id the vocabulary spells `label` with as one token: bare, SentencePiece's "▁A" and
    byte-level BPE's "ĠA" (which one carries the mass depends on what the prompt ended with)."""
    ids = []
    for spelling in (label, f"\u2581{label}", f"\u0120{label}"):
        token = tokenizer.token_to_id(spelling)
        if token is not None and token not in ids:
            ids.append(token)
    if not ids:
        raise Refusal(f'this tokenizer has no single token for the answer label "{label}", so it cannot be read '
                      "from one position")
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


def _fork(model, cache, rows: int, capacity: int):
    """A cache of `rows` rows holding `cache`'s one row of shared slots, ready for suffixes."""
    fork = model.new_cache(rows, capacity)
    used = cache.length
    for layer in range(len(fork.keys)):
        fork.keys[layer][:, :, :used] = cache.keys[layer][:, :, :used]
        fork.values[layer][:, :, :used] = cache.values[layer][:, :, :used]
    fork.positions[:, :used] = cache.positions[:, :used]
    fork.valid[:, :used] = cache.valid[:, :used]
    fork.length = used
    return fork


@torch.inference_mode()
def letter_logits(model, prefix: list[int], suffixes: list[list[int]], labels: list[list[list[int]]],
                  pad_id: int = 0, chunk: int = 8) -> list[list[float]]:
    """Per suffix, per answer position, the log-sum-exp of that letter's spellings' logits."""
    width = max(len(s) for s in suffixes)
    shared = model.new_cache(1, len(prefix) + 1)
    if prefix:
        model(torch.tensor([prefix]), cache=shared, last_only=True)
    out = []
    for start in range(0, len(suffixes), chunk):
        group = suffixes[start:start + chunk]
        cache = _fork(model, shared, len(group), len(prefix) + width)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        valid = torch.zeros((len(group), width), dtype=torch.bool)
        for row, suffix in enumerate(group):
            ids[row, width - len(suffix):] = torch.tensor(suffix)
            valid[row, width - len(suffix):] = True
        positions = len(prefix) + (valid.long().cumsum(1) - 1).clamp(min=0)
        logits = model(ids, positions, valid, cache, last_only=True)[:, -1].double()
        for row, label_ids in enumerate(labels[start:start + chunk]):
            out.append([float(torch.logsumexp(logits[row, ids_], 0)) for ids_ in label_ids])
    return out


class LetterLogitsOnRank(RankExtension):
    """Reads the option letters' logits on one rank; the shared prefix's cache lives only for one call."""

    def letter_logits(self, prefix, suffixes, labels, pad_id, chunk):
        return self.first_rank_only(letter_logits(self.model, prefix, suffixes, labels, pad_id, chunk))


def decide(group, tokenizer, cfg, request: Request, permutations: int, chat_template: str, explain: bool,
           pad_id: int, progress, chunk: int = 8) -> dict:
    """answers, explain (optional) and usage for `request` on `group`'s ranks."""
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
            if len(ids) > cfg.max_position:
                raise Refusal(f"question '{question.id}' renders to {len(ids)} tokens, past the {cfg.max_position} "
                              "this model was built for; shorten the state or the question")
            rows.append(ids)
            owners.append(index)
            row_orders.append(order)
            labels.append([spellings[p] for p in range(len(options))])
    shared = shared_prefix(rows)
    suffixes = [r[shared:] for r in rows]
    between = sum(len(s) for s in suffixes)
    progress(f"reading the state once ({shared} tokens), then {len(rows)} question renderings "
             f"({between} tokens between them)")
    read = group.on(LetterLogitsOnRank).letter_logits(rows[0][:shared], suffixes, labels, pad_id, chunk)[0]
    per_question: list[tuple[list, list]] = [([], []) for _ in request.questions]
    for owner, order, row in zip(owners, row_orders, read):
        canonical = [0.0] * len(order)
        for position, option in enumerate(order):
            canonical[option] = row[position]
        per_question[owner][0].append(canonical)
        per_question[owner][1].append(order)
    answers, explained = {}, {}
    for question, (question_rows, question_orders) in zip(request.questions, per_question):
        answers[question.id] = arithmetic.answer(question, arithmetic.probabilities(question_rows))
        if explain:
            explained[question.id] = arithmetic.explanation(question, question_rows, question_orders)
    out = {"answers": answers}
    if explain:
        out["explain"] = explained
    out["usage"] = {"input_tokens": shared + between, "forward_passes": int(shared > 0) + len(rows),
                    "output_tokens": 0}
    return out
