"""Hashed n-gram embeddings beside the token embedding (LongCat-Flash-Lite's ngram_embeddings).

For each n-gram order o from 2 to `neighbors` and each of `splits` tables, the token and the o - 1
tokens before it hash to (token + sum_d previous_d * (vocab^d mod rows)) mod rows in table (o - 2) *
splits + j, whose rows the config states (NgramConfig.rows); the row found passes that table's post
projection (width -> hidden), and the token embedding and every projection are averaged. A token
before the start of its run counts as zero: a run starts at a sequence's first token and after each
of NgramConfig.breaks (the config's eos_token_id).

Across steps each sequence keeps its last neighbors - 1 tokens as a recurrent state of its own
(`state_key`), which the static cache and the paged cache's state slots hold like a recurrent
layer's (model/paged.py gathers every module that has one). The state holds token + 1 (0: before the
run) as three base-256 digits, so any float dtype the cache keeps holds it exactly. Under tensor
parallelism each table's rows are split like the vocab embedding's; the projections are replicated,
and the projected sum of the rank's rows is all-reduced once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import ModelConfig
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ShardedModule, VocabEmbedding, dense

_DIGITS = 3  # base-256 digits of token + 1: up to 2**24 - 1 tokens, exact in bf16


def _encode(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([(values >> (8 * d)) & 255 for d in range(_DIGITS)], dim=-1).to(dtype)


def _decode(digits: torch.Tensor) -> torch.Tensor:
    d = digits.round().long()
    return sum(d[..., i] << (8 * i) for i in range(_DIGITS))


class Projection(ShardedModule):
    """A post projection, [hidden, width] as stored, held whole by every rank."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self._param("weight", Shard((hidden, width)))


class NgramEmbedding(torch.nn.Module):
    state_key = "ngram"

    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx):
        super().__init__()
        ngram = cfg.ngram
        self.ctx, self.vocab, self.neighbors, self.breaks = (
            ctx,
            cfg.vocab_size,
            ngram.neighbors,
            ngram.breaks,
        )
        self.splits = len(ngram.rows) // (ngram.neighbors - 1)
        width = cfg.hidden_size // len(ngram.rows)
        self.embedders = torch.nn.ModuleList(
            VocabEmbedding(rows, width, ctx) for rows in ngram.rows
        )
        self.post_projs = torch.nn.ModuleList(
            Projection(cfg.hidden_size, width) for _ in ngram.rows
        )
        # per table: vocab^d mod rows for d = 1 .. order - 1
        self.mods = [
            [pow(cfg.vocab_size, d, rows) for d in range(1, 2 + index // self.splits)]
            for index, rows in enumerate(ngram.rows)
        ]
        self.rows = ngram.rows

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.neighbors - 1, _DIGITS),)

    def forward(self, ids: torch.Tensor, embedded: torch.Tensor, step) -> torch.Tensor:
        """The averaged embedding [batch, seq, hidden] of ids [batch, seq] whose token embedding is
        `embedded`."""
        dtype = embedded.dtype
        context = step.recur(self.state_key, _encode(ids + 1, dtype), self._scan, self._fresh)
        total = None
        for index, (table, proj) in enumerate(zip(self.embedders, self.post_projs)):
            rows = self.rows[index]
            hashed = context[..., 0].clone()
            for d, mod in enumerate(self.mods[index], start=1):
                hashed = hashed + context[..., d] * mod
            part = dense(self._local(table, hashed % rows), proj.weight)
            total = part if total is None else total + part
        if self.ctx.tp_size > 1:
            total = self.ctx.all_reduce(total)
        return (embedded + total) / (1 + len(self.rows))

    def _local(self, table: VocabEmbedding, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `table` for ids (zero where another rank holds the row): the
        all-reduce of the projected sum completes them."""
        if self.ctx.tp_size == 1:
            return F.embedding(ids, table.weight)
        local = ids - table.start
        outside = (local < 0) | (local >= table.stop - table.start)
        return F.embedding(local.masked_fill(outside, 0), table.weight).masked_fill(
            outside.unsqueeze(-1), 0
        )

    def _fresh(self, n: int) -> tuple[torch.Tensor, ...]:
        return (self.post_projs[0].weight.new_zeros((n, self.neighbors - 1, _DIGITS)),)

    def _scan(
        self, x: torch.Tensor, valid: torch.Tensor | None, state: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """x: token + 1 as digits [rows, seq, 3]; returns each token and the neighbors - 1 tokens
        before it [rows, seq, neighbors] (zero before its run), and the last neighbors - 1 of them
        as the new state. A padding token (left padding, before a row's first) counts as before the
        run."""
        current = _decode(x)
        if valid is not None:
            current = current.masked_fill(~valid, 0)
        seq = current.shape[1]
        context = torch.cat([_decode(state[0]), current], dim=1)  # token + 1; 0 before the run
        at = torch.arange(context.shape[1], device=context.device)
        ends = context == 0
        for token in self.breaks:
            ends = ends | (context == token + 1)
        last_end = torch.where(ends, at, -1).cummax(dim=1).values
        # the last position at or before which nothing counts, for the token at each position
        before = torch.cat([last_end.new_full((context.shape[0], 1), -1), last_end[:, :-1]], dim=1)
        tokens = at[-seq:]
        columns = [(context[:, -seq:] - 1).clamp(min=0)]
        for d in range(1, self.neighbors):
            src = tokens - d
            seen = (src > before[:, -seq:]) & (src >= 0)
            columns.append(torch.where(seen, context[:, src.clamp(min=0)] - 1, 0))
        new_state = _encode(context[:, -(self.neighbors - 1) :], state[0].dtype)
        return torch.stack(columns, dim=-1), (new_state,)
