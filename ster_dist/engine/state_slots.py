"""The recurrent-state slots of the paged cache: which are free, on the driver.

A model with recurrent layers (Mamba, gated delta nets, short convolutions) keeps one state per
running sequence beside its KV blocks, in slot `Sequence.state` of every rank's PagedCache. Like
block ids, slot ids are the driver's and the same on every rank; the scheduler takes one when it
admits a sequence and gives it back when the sequence finishes, is aborted or is preempted. A slot
is not cleared on its way back: a sequence's first chunk starts at position 0, and the ranks read
fresh state there (PagedStep.recur), so whatever the last holder left is never read.
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, count: int):
        if count < 1:
            raise ValueError(
                f"a model with recurrent layers needs at least one state slot, got {count}"
            )
        self.count = count
        self._free = list(range(count - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise ValueError(
                f"all {self.count} state slots are held: admit no more running sequences than slots"
            )
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.count or slot in self._free:
            raise ValueError(f"state slot {slot} is not held")
        self._free.append(slot)
