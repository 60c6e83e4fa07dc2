"""Reading the residual stream at the hook sites (after layer i), on the ranks.

`CaptureOnRank.capture` runs on every rank (a rank extension): a left-padded batch goes through the
decoder with a hook per requested layer, and the forward stops right after the deepest one (no
later layer, no head). The residual is replicated over tensor-parallel ranks, so every rank stops
at the same layer and only the first rank of each pipeline stage returns what it read (its own
layers; a stage past the deepest layer does not run). Rows are F32 whatever the precision.

`capture` is the driver's side: batches of token ids in, per batch {layer: rows} out, in order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ster_dist.model.cache import left_pad
from ster_dist.workers.extension import RankExtension

POSITIONS = ("last", "all")


class _Done(Exception):
    """Raised by the deepest capture hook: what was asked has been read, skip the rest."""


@torch.inference_mode()
def read_hidden(
    model, prompts: list[list[int]], layers: list[int], positions: str, pad_id: int = 0
) -> dict[int, torch.Tensor]:
    """{layer: rows} for a batch: the last token of each prompt ([batch, hidden]) or every real
    token of every prompt, prompt after prompt ([sum of lengths, hidden])."""
    ids, pos, valid = left_pad(prompts, pad_id)
    out: dict[int, torch.Tensor] = {}
    deepest = max(layers)

    def reader(layer: int):
        def hook(h: torch.Tensor):
            out[layer] = (h[:, -1] if positions == "last" else h[valid]).float().clone()
            if layer == deepest:
                raise _Done

        return hook

    if model.stage[0] > deepest:  # a pipeline stage past every requested layer: nothing reaches it
        return out
    removers = [model.add_hook(layer, reader(layer)) for layer in layers]
    try:
        model(ids, pos, valid)
    except _Done:
        pass
    finally:
        for remove in removers:
            remove()
    return out


class CaptureOnRank(RankExtension):
    """Reads the residual on one rank; it holds nothing between calls (each read removes its
    hooks)."""

    def capture(self, prompts: list[list[int]], layers: list[int], positions: str, pad_id: int):
        # each pipeline stage reads the layers it holds; the driver merges them
        return self.stage_lead_only(read_hidden(self.model, prompts, layers, positions, pad_id))


def capture(
    group, encoded: list[list[int]], layers: list[int], positions: str, pad_id: int, batch_size: int
) -> Iterator[tuple[int, dict[int, torch.Tensor]]]:
    """(first prompt index, {layer: rows}) per batch of `batch_size` prompts, in order."""
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start : start + batch_size]
        rows: dict[int, torch.Tensor] = {}
        for part in group.on(CaptureOnRank).capture(batch, layers, positions, pad_id):
            rows.update(part or {})
        yield start, rows


def last_token_rows(
    group, encoded: list[list[int]], layers: list[int], pad_id: int, batch_size: int, on_batch=None
) -> dict[int, torch.Tensor]:
    """{layer: [prompts, hidden]}: every prompt's final-token activation at every layer."""
    parts: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    for start, rows in capture(group, encoded, layers, "last", pad_id, batch_size):
        for layer in layers:
            parts[layer].append(rows[layer])
        if on_batch is not None:
            on_batch(min(start + batch_size, len(encoded)), len(encoded))
    return {layer: torch.cat(chunks) for layer, chunks in parts.items()}
