"""The paged KV cache: per layer, this rank's keys and values in fixed-size blocks that the driver
hands to sequences, and Chunk, one sequence's share of a paged step.

A sequence's keys live in the blocks of its block table, position p in block p // block_size at
offset p % block_size, so a key's slot within the gathered table is its position. Block ids are the
driver's and the same on every rank; each rank stores only its own key-value heads (or, for latent
attention, the latent and the shared rotated key part, which every rank holds whole), so tensor
parallelism needs no exchange of keys. `model` is a Decoder, typed as a module: the decoder imports
this one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a paged step."""

    # physical block ids covering positions [0, start + length); block i holds positions [i*bs,
    # (i+1)*bs)
    blocks: tuple[int, ...]
    # tokens of this sequence already in the cache = position of its first new token
    start: int
    length: int  # new tokens this step, >= 1
    # the sequence's state slot in recurrent layers (-1: the model has none)
    state: int = -1
    # a prefix LM's prompt length: positions below it attend each other both ways (the chunk reads
    # them all)
    prefix: int = 0


def _slot_shapes(model: nn.Module) -> list[tuple[tuple[int, int], tuple[int, int]] | None]:
    """Per layer, the (heads, width) one position's key and value take on this rank; None where the
    layer keeps no keys (a recurrent layer)."""
    return [getattr(block.token_mixer, "kv_shape", None) for block in model.layers]


def state_shapes(model: nn.Module) -> dict[int | tuple[int, str], tuple[tuple[int, ...], ...]]:
    """Per recurrent layer (its index), and per module keeping a state of its own within a layer
    (its
    `state_key`: Inkling's short convolutions, model/residual_conv.py), the shapes of one sequence's
    state on this rank."""
    shapes = {
        i: block.token_mixer.state_shapes()
        for i, block in enumerate(model.layers)
        if hasattr(block.token_mixer, "state_shapes")
    }
    for module in model.modules():
        key = getattr(module, "state_key", None)
        if key is not None:
            shapes[key] = module.state_shapes()
    return shapes


class PagedCache:
    """Per attention layer, this rank's keys and values in fixed-size blocks: [num_blocks,
    block_size, local_kv_heads, head_dim] (latent attention: the normed latent [num_blocks,
    block_size, 1, kv_lora_rank] and the rotated shared key part [num_blocks, block_size, 1,
    rope_dim], one shared "head" each); per recurrent layer,
    `state_slots`
    sequences' states, [state_slots, *shape] each, a slot per running sequence (Chunk.state)."""

    # never handed out by the driver; stands in for blocks a sliding window has released (masked
    # anyway)
    NULL_BLOCK = 0

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        state_slots: int = 0,
    ):
        if block_size < 1 or num_blocks < 2:
            raise ValueError(
                f"a paged cache needs block_size >= 1 and num_blocks >= 2 (block {self.NULL_BLOCK} is "
                f"the null block); got block_size {block_size}, num_blocks {num_blocks}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype or model.dtype
        device = model.device

        def blocks(shape):
            return torch.zeros((num_blocks, block_size, *shape), dtype=self.dtype, device=device)

        shapes = _slot_shapes(model)
        self.keys = [blocks(kv[0]) if kv is not None else None for kv in shapes]
        self.values = [blocks(kv[1]) if kv is not None else None for kv in shapes]
        # recurrent state is kept in the model's dtype: a scan's state accumulates, and rounding it to a narrower
        # cache dtype every step would drift from the whole read
        state_dtype = model.dtype
        self.state_slots = state_slots
        self.states = {
            layer: tuple(
                torch.zeros((state_slots, *shape), dtype=state_dtype, device=device)
                for shape in layer_shapes
            )
            for layer, layer_shapes in state_shapes(model).items()
        }

    @staticmethod
    def block_bytes(model: nn.Module, block_size: int, dtype: torch.dtype | None = None) -> int:
        """What one block costs on this rank, all layers."""
        itemsize = (dtype or model.dtype).itemsize
        per_position = sum(
            math.prod(kv[0]) + math.prod(kv[1]) for kv in _slot_shapes(model) if kv is not None
        )
        return per_position * block_size * itemsize

    @staticmethod
    def state_bytes(model: nn.Module) -> int:
        """What one sequence's recurrent state costs on this rank, all layers (0 for attention-only
        models)."""
        itemsize = model.dtype.itemsize
        return (
            sum(math.prod(shape) for shapes in state_shapes(model).values() for shape in shapes)
            * itemsize
        )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the keys and values [1, heads, tokens, width] of packed tokens at flat slots
        [tokens] (block * block_size + offset)."""
        for store, x in ((self.keys[layer], k), (self.values[layer], v)):
            flat = store.view(-1, *store.shape[2:])
            flat.index_copy_(
                0, slots, x[0].transpose(0, 1).reshape(-1, *store.shape[2:]).to(store.dtype)
            )

    def gather(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [sequences, heads, blocks * block_size, width] of block tables
        [sequences, blocks]; slot i of a row holds that sequence's position i."""
        return self._read(self.keys[layer], table), self._read(self.values[layer], table)

    @staticmethod
    def _read(store: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        rows = store[table]  # [n, blocks, block_size, *slot]
        n, slots = rows.shape[0], rows.shape[1] * rows.shape[2]
        return rows.view(n, slots, -1, store.shape[-1]).transpose(1, 2)
