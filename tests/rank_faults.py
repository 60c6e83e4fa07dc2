"""Rank extensions that fail on purpose, for the tests of how a group reports a rank's failure."""

from __future__ import annotations

from ster_dist.workers.extension import RankExtension


class AllocatesTooMuch(RankExtension):
    def allocate(self, exponent: int = 50) -> int:
        # far past any machine: malloc refuses at once, so Python raises a real MemoryError
        return len(bytearray(1 << exponent))
