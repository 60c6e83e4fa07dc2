"""A batch of prompts left-padded to one length (`left_pad`: what a whole-batch forward such as
capture's reads), and the static cache of such a batch: per attention layer, this rank's key and
value heads for every slot, and per recurrent layer, each row's state.

Slots are shared by the batch (prompts are left-padded to one length); each row
keeps its own positions and which slots hold real tokens, so padding is never
attended and positions skip it. A recurrent layer (Mamba, gated delta, short
convolution) keeps no slots, only the state its scan left (`states`), row by row.

The positions and validity of the slots are bookkeeping, kept on the host whatever device holds the
keys: a step decides its masks and kernels from them without reading the device (model/host.py).
"""

from __future__ import annotations

import torch

from ster_dist.errors import Refusal

# per layer: ((key heads, key width), (value heads, value width)) one position keeps, or None (no
# attention)
KVShapes = list[tuple[tuple[int, int], tuple[int, int]] | None]


def left_pad(
    prompts: list[list[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, valid) for prompts left-padded to one length; positions skip the padding."""
    if any(len(p) == 0 for p in prompts):
        raise Refusal(
            "a prompt encodes to no tokens; give it some text or turn the chat template on"
        )
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        valid[row, width - len(prompt) :] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids, positions, valid


class KVCache:
    def __init__(
        self,
        shapes: KVShapes,
        batch: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        def slots(heads_width):
            heads, width = heads_width
            return torch.zeros((batch, heads, capacity, width), dtype=dtype, device=device)

        self.keys = [slots(shape[0]) if shape is not None else None for shape in shapes]
        self.values = [slots(shape[1]) if shape is not None else None for shape in shapes]
        # recurrent layer -> its state, rows first
        self.states: dict[int, tuple[torch.Tensor, ...]] = {}
        self.positions = torch.zeros(batch, capacity, dtype=torch.long)  # on the host (above)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool)
        self.length = 0
        self.capacity = capacity
        self._kernel_views: tuple[list, list] | None = None

    def reserve(self, positions: torch.Tensor, valid: torch.Tensor) -> slice:
        """Claim the next slots for a [batch, seq] step of host positions and validity; returns
        them."""
        seq = positions.shape[1]
        if self.length + seq > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {seq} > {self.capacity} slots")
        slots = slice(self.length, self.length + seq)
        self.positions[:, slots] = positions
        self.valid[:, slots] = valid
        self.length += seq
        return slots

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's keys and values of slots [0, end), as write returns them."""
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def kernel_views(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Every layer's keys and values [batch, capacity, heads, width], as the decode kernel reads
        a paged cache (a block a row); views of the slots, made once."""
        if self._kernel_views is None:
            self._kernel_views = (
                [k.transpose(1, 2) if k is not None else None for k in self.keys],
                [v.transpose(1, 2) if v is not None else None for v in self.values],
            )
        return self._kernel_views

    def write(self, layer: int, slots: slice, k: torch.Tensor, v: torch.Tensor):
        # narrow and copy_ rather than indexing: a decode step writes every layer, and Python's
        # tuple indexing
        # costs several times the copy of one token's keys
        keys, values, count = self.keys[layer], self.values[layer], slots.stop - slots.start
        keys.narrow(2, slots.start, count).copy_(k)
        values.narrow(2, slots.start, count).copy_(v)
        return keys.narrow(2, 0, slots.stop), values.narrow(2, 0, slots.stop)
