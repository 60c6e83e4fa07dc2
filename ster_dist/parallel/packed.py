"""Weights packed ahead for oneDNN's products on a CPU: a token engine's choice (engine/runner.py), as vLLM's
CPU backend packs its linear layers' weights at load.

Given a weight as it is stored, oneDNN's matmul first reorders it into its own blocked layout, on every call.
Reordered once ahead (`mkldnn._reorder_linear_weight`), the same product gives the same numbers and skips that
copy: on SmolLM2's shapes on an AVX-512 CPU, f32 products of 32 rows took 1.13-1.28x as long with the plain
weight, of 512 rows 1.04-1.15x; at 4-8 rows the packed product also beats the few-row kernel (1.2-2.5x at
5-8 rows), which stays faster at 1-3 (bench/README.md).

The packed copy sits beside the parameter, which everything else keeps reading (the few-row kernel, capture,
adapters, saving): the price is a second copy of each packed weight, which the engine pays only where it
fits (`--pack-weights`). A packed copy is found by the address, shape and strides of the weight a product is
handed, so a compiled step's graph (whose inputs are the parameters themselves) finds it too. An entry holds
its weight weakly and lives no longer than it; a weight changed in place since it was packed (a tuning step)
is read plain again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

# products of this many rows or more take a packed weight where one exists: below, the few-row kernel is faster
ROWS_MIN = 4
PACKING_ROWS = 32  # the batch size oneDNN is told to expect: any row count runs on what it packs


@dataclass
class _Entry:
    version: int | None  # None: an inference tensor, which keeps no version counter
    packed: torch.Tensor
    finalizer: weakref.finalize  # holds the weight weakly; drops the entry when the weight is freed


_TABLE: dict[tuple, _Entry] = {}
_ANY = False  # whether _TABLE holds an entry: all a compiled step's guard on active() then reads


def available() -> bool:
    """Whether this torch can pack weights for oneDNN (built with it, the reorder operator present)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def active() -> bool:
    """Whether any weight of this process is packed: dense() then sends products of ROWS_MIN rows or more to
    oneDNN, which takes the packed copy where it finds one (a constant to a compiled step, guarded)."""
    return _ANY


def _key(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype


def _version(weight: torch.Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:  # an inference tensor
        return None


def packable(weight: torch.Tensor) -> bool:
    """A 2-D contiguous f32 or bf16 CPU weight that no gradient flows into."""
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous()
            and not weight.requires_grad and weight.numel() > 0)


def pack(weight: torch.Tensor) -> int:
    """Pack `weight` (once: a weight already packed is left); returns the bytes its packed copy takes."""
    key = _key(weight)
    if key in _TABLE:
        return 0
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS)
    gone = weakref.finalize(weight, _forget, key)  # the weight freed: its address may be reused
    _TABLE[key] = _Entry(_version(weight), packed, gone)
    _recount()
    return weight.nbytes


def release(weights) -> None:
    """Drop the packed copies of `weights` (an engine closing)."""
    for weight in weights:
        _drop(_key(weight))


def lookup(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of `weight`, or None: never packed, or changed in place since (then dropped)."""
    key = _key(weight)
    entry = _TABLE.get(key)
    if entry is None:
        return None
    alive = entry.finalizer.peek()  # (weight, func, args, kwargs) while the weight lives
    if alive is None or entry.version != _version(alive[0]):
        _drop(key)
        return None
    return entry.packed


def _drop(key: tuple) -> None:
    entry = _TABLE.pop(key, None)
    if entry is not None:
        entry.finalizer.detach()
    _recount()


def _forget(key: tuple) -> None:
    _TABLE.pop(key, None)
    _recount()


def _recount() -> None:
    global _ANY
    _ANY = bool(_TABLE)
