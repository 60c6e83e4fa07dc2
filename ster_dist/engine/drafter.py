"""The rank side of MTP speculative decoding: the MTP layer's own paged cache, and each sequence's
last chunk of hidden states, from which the next step's drafts are made.

The MTP row of position q reads the model's hidden state at q and token q + 1, so it can run only
once token q + 1 is known: the rows of a step's chunk wait, on every rank alike, for the sequence's
next chunk, whose start says how many of them stood (a verified draft keeps only its accepted
tokens) and whose first token is the one after the last. propose() runs those rows (writing the MTP
layer's keys there, its catch-up) and, for a decode the driver asked drafts of, chains the layer on
its own output: its argmax at the last row is draft 1, and row by row its output and the last draft
make the next. Every rank computes the same drafts from the same gathered logits, so no rank waits
on another for them. A sequence restarted (preemption) or served from the prefix cache has no rows
waiting and drafts nothing that step. The MTP keys of the positions before its first chunk are those
of the blocks it shares, which the driver lets it share only when they are all written and the last
one read the token it has there (engine/blocks.py's drafted marks, set by the scheduler once a
step's catch-up passed a block's end): its cache is then the one a cold run leaves, and it drafts as
a cold run would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ster_dist import kernels
from ster_dist.model.paged import Chunk


@dataclass
class _Rows:
    start: int  # the position of the chunk's first token
    ids: list[int]  # the chunk's tokens, drafts included
    hidden: torch.Tensor  # the model's final-norm output there [len(ids), hidden]


class MTPDrafter:
    def __init__(self, main, draft, num_blocks: int, block_size: int):
        self.main, self.draft = main, draft
        self.cache = draft.new_cache(num_blocks, block_size)
        self._waiting: dict[str, _Rows] = {}

    def forget(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._waiting.pop(seq_id, None)

    def propose(
        self,
        seq_ids: list[str | None],
        chunks: list[Chunk],
        firsts: list[int],
        wanted: dict[int, int],
    ) -> dict[int, list[int]]:
        """Drafts by chunk index (at most wanted[i] for chunk i) after the catch-up of every chunk's
        waiting rows;
        `firsts`: each chunk's first new token; seq_ids[i] None: a sequence that never drafts."""
        ids, hidden, rows, owners = [], [], [], []
        for i, (seq_id, chunk) in enumerate(zip(seq_ids, chunks)):
            waiting = self._waiting.pop(seq_id, None) if seq_id is not None else None
            stood = chunk.start - waiting.start if waiting is not None else 0
            if not 0 < stood <= len(waiting.ids if waiting else ()):
                continue  # nothing waiting, or the sequence restarted from elsewhere (preemption)
            ids += waiting.ids[1:stood] + [firsts[i]]
            hidden.append(waiting.hidden[:stood])
            rows.append(Chunk(chunk.blocks, waiting.start, stood))
            owners.append(i)
        if not rows:
            return {}
        out, logits = self._run(torch.cat(hidden), ids, rows)
        ends = torch.tensor([c.length for c in rows]).cumsum(0) - 1
        picked = kernels.argmax(logits).tolist()
        drafts = {i: [picked[m]] for m, i in enumerate(owners) if wanted.get(i, 0) > 0}
        last = {i: out[ends[m]] for m, i in enumerate(owners) if i in drafts}
        for j in range(1, max(wanted.values(), default=0)):
            chain = [i for i in drafts if wanted[i] > j]
            if not chain:
                break
            rows = [Chunk(chunks[i].blocks, chunks[i].start - 1 + j, 1) for i in chain]
            out, logits = self._run(
                torch.stack([last[i] for i in chain]), [drafts[i][-1] for i in chain], rows
            )
            picked = kernels.argmax(logits).tolist()
            for m, i in enumerate(chain):
                drafts[i].append(picked[m])
                last[i] = out[m]
        return drafts

    def keep(
        self, seq_ids: list[str | None], chunks: list[Chunk], ids: list[int], hidden: torch.Tensor
    ) -> None:
        """A step's chunks (drafts included) and the model's final-norm output over them [tokens,
        hidden]; none for a sequence that never drafts (seq_ids[i] None)."""
        offset = 0
        for seq_id, chunk in zip(seq_ids, chunks):
            end = offset + chunk.length
            if seq_id is not None:
                self._waiting[seq_id] = _Rows(
                    chunk.start, ids[offset:end], hidden[offset:end].clone()
                )
            offset = end

    def _run(self, hidden: torch.Tensor, ids: list[int], rows: list[Chunk]):
        device = self.main.device
        return self.draft.forward_paged(
            self.main, hidden, torch.tensor(ids, dtype=torch.long, device=device), rows, self.cache
        )
