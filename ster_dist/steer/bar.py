"""A progress bar for batched reads, as progress events on stderr (one JSON line per batch, with
the bar drawn in the message and done / total as fields for machines)."""

from __future__ import annotations

from ster_dist.events import progress


def bar(what: str, width: int = 24):

    def update(done: int, total: int) -> None:
        filled = width * done // max(total, 1)
        progress(
            f"{what} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
            done=done,
            total=total,
        )

    return update
