"""The static KV cache: per layer, this rank's key and value heads for every slot of a batch.

Slots are shared by the batch (prompts are left-padded to one length); each row
keeps its own positions and which slots hold real tokens, so padding is never
attended and positions skip it.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.length = 0
        self.capacity = capacity

    def reserve(self, positions: torch.Tensor, valid: torch.Tensor) -> slice:
        """Claim the next slots for a [batch, seq] step; returns them."""
        seq = positions.shape[1]
        if self.length + seq > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {seq} > {self.capacity} slots")
        slots = slice(self.length, self.length + seq)
        self.positions[:, slots] = positions
        self.valid[:, slots] = valid
        self.length += seq
        return slots

    def write(self, layer: int, slots: slice, k: torch.Tensor, v: torch.Tensor):
        self.keys[layer][:, :, slots] = k
        self.values[layer][:, :, slots] = v
        end = slots.stop
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
