"""Weights packed ahead for a CPU's products: a token engine's choice (engine/runner.py), as vLLM's
CPU backend packs its linear layers' weights at load.

Where this package's kernels were built with AVX-512 (and AVX512_BF16 for bf16), a weight is laid
out in panels of 32 outputs (kernels/panels.cpp) and every product over it, of any number of rows,
runs there: on SmolLM2's shapes, 2 threads, 1.2-1.9x oneDNN's own packed product at 4-64 rows, equal
at 512, as fast as the few-row kernel at one row (bench/README.md); and a row's product is the same
bits in any batch. With AVX2 (and FMA) an f32 or bf16 weight is laid out in panels of 16 outputs: on
a Zen 3 CPU, f32, 1.06x the few-row kernel at one row, 1.24x at 8, 1.2-1.4x oneDNN's packed product
at 12-32 rows, 1.06-1.12x at 256; bf16 1.6x the few-row kernel at 8 rows. Elsewhere (bf16 on AVX-512
without AVX512_BF16, or no kernels built) the weight is reordered once into oneDNN's blocked layout
(`mkldnn._reorder_linear_weight`), which oneDNN's matmul otherwise makes on every call: products of
ROWS_MIN rows or more then take it (1.13-1.28x at 32 f32 rows, 1.04-1.15x at 512), and the few-row
kernel keeps fewer. A bf16 weight on a CPU without native bf16 products and without panels, where
oneDNN refuses to reorder bf16, is reordered as an f32 copy instead (widened()).

The packed copy sits beside the parameter, which everything else keeps reading (capture, adapters,
merges, saving): the price is a second copy of each packed weight, which the engine pays only where
it fits (`--pack-weights`). A packed copy is found by the address, shape and strides of the weight a
product is handed, so a compiled step's graph (whose inputs are the parameters themselves) finds it
too. An entry holds its weight weakly and lives no longer than it; a weight changed in place since
it was packed (a tuning step) is read plain again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ster_dist import kernels

# products of this many rows or more take a weight packed for oneDNN where one exists: below, the
# few-row kernel
# is faster (a weight in panels takes every row count). With AVX-512 oneDNN's packed product
# overtook it at 4
# rows; on an AVX2 CPU (Zen 3) the few-row kernel stayed ahead through all of its 8 rows
# (bench/products.py,
# SmolLM2's f32 products: 25.2 against 32.0 ms at 4 rows, 32.9 against 36.7 at 8).
ROWS_MIN = (
    4 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else kernels.FEW_ROWS_MAX + 1
)
PACKING_ROWS = 32  # the batch size oneDNN is told to expect: any row count runs on what it packs


@dataclass(frozen=True)
class Packed:
    tensor: torch.Tensor
    panels: bool  # laid out by kernels/panels.cpp (else by oneDNN's reorder)
    # a bf16 weight reordered as f32: products of its dtype run in f32 over it (widened())
    widened: bool = False


@dataclass
class _Entry:
    version: int | None  # None: an inference tensor, which keeps no version counter
    packed: Packed
    finalizer: weakref.finalize  # holds the weight weakly; drops the entry when the weight is freed


_TABLE: dict[tuple, _Entry] = {}
_ANY = False  # whether _TABLE holds an entry: all a compiled step's guard on active() then reads


# whether this CPU multiplies bf16 / f16 natively: oneDNN's bf16 kernels, and its reorder of a bf16
# weight, need
# AVX-512 or AVX-NE-CONVERT (on AVX2 the reorder refuses, and torch's own bf16 product is 5x slower
# than f32's)
NATIVE_HALF_PRODUCTS = torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


def available() -> bool:
    """Whether weights can be packed here: in panels (this package's kernels, AVX2 or AVX-512), or
    for oneDNN (a torch built with it, the reorder operator present)."""
    return kernels.panels(torch.float32) or _onednn(torch.float32)


def _onednn(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder a `dtype` weight here (f32 anywhere it is built in, bf16 where the
    CPU has native half products)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype == torch.float32 or NATIVE_HALF_PRODUCTS)
    )


def active() -> bool:
    """Whether any weight of this process is packed: dense() then sends products of a dtype laid out
    in panels, and of ROWS_MIN rows or more, to ster_kernels::packed_product, which takes the packed
    copy where it finds one (ster_dist::cpu_linear without the kernels, or where gradients flow). A
    constant to a compiled step, guarded."""
    return _ANY


def _key(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype


def _version(weight: torch.Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:  # an inference tensor
        return None


def widened(dtype: torch.dtype) -> bool:
    """Whether a `dtype` weight is packed as an f32 copy: bf16 on a CPU without native bf16 products
    (AVX2), where torch's bf16 kernel is 5x slower than f32 and widening the weight on every product
    (linear.py's _upcast) costs as much as the product. The copy takes twice the bf16 weight;
    products of 1-8 rows still read the bf16 one."""
    return (
        dtype == torch.bfloat16
        and not kernels.panels(dtype)
        and not _onednn(dtype)
        and _onednn(torch.float32)
    )


def packable(weight: torch.Tensor) -> bool:
    """A 2-D contiguous f32 or bf16 CPU weight that no gradient flows into, and a way to pack its
    dtype here."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.is_contiguous()
        and not weight.requires_grad
        and weight.numel() > 0
        and (kernels.panels(weight.dtype) or _onednn(weight.dtype) or widened(weight.dtype))
    )


def copy_bytes(weight: torch.Tensor) -> int:
    """The bytes `weight`'s packed copy takes (a packable weight)."""
    if kernels.panels(weight.dtype):
        return panel_bytes(weight)
    return weight.numel() * 4 if widened(weight.dtype) else weight.nbytes


def pack(weight: torch.Tensor, into: torch.Tensor | None = None) -> int:
    """Pack `weight` (once: a weight already packed is left); returns the bytes its packed copy
    takes. Panels are written `into` where given (bytes, panel_bytes of them), else into memory of
    their own."""
    key = _key(weight)
    if key in _TABLE:
        return 0
    with torch.no_grad():
        if kernels.panels(weight.dtype):
            packed = Packed(torch.ops.ster_kernels.pack_panels(weight.detach(), into), panels=True)
            torch.ops.ster_kernels.hold_panels(weight.detach(), packed.tensor)
        else:
            wide = widened(weight.dtype)
            source = weight.detach().float() if wide else weight.detach()
            packed = Packed(
                torch.ops.mkldnn._reorder_linear_weight(source, PACKING_ROWS),
                panels=False,
                widened=wide,
            )
            if kernels.ready():  # where packed_product finds it (linear.py's dense())
                torch.ops.ster_kernels.hold_onednn(weight.detach(), packed.tensor, wide)
    gone = weakref.finalize(weight, _forget, key)  # the weight freed: its address may be reused
    _TABLE[key] = _Entry(_version(weight), packed, gone)
    _recount()
    return copy_bytes(weight)


def panel_bytes(weight: torch.Tensor) -> int:
    """The bytes `weight`'s panels take (where kernels.panels(weight.dtype); kernels/panels.cpp lays
    them out)."""
    return torch.ops.ster_kernels.panel_bytes(weight)


def release(weights) -> None:
    """Drop the packed copies of `weights` (an engine closing)."""
    for weight in weights:
        _drop(_key(weight))


def lookup(weight: torch.Tensor) -> Packed | None:
    """The packed copy of `weight`, or None: never packed, or changed in place since (then
    dropped)."""
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
        _unhold(key, entry)
    _recount()


def _forget(key: tuple) -> None:
    entry = _TABLE.pop(key, None)
    if entry is not None:
        _unhold(key, entry)
    _recount()


def _unhold(key: tuple, entry: _Entry) -> None:
    if kernels.ready():
        torch.ops.ster_kernels.drop_held(key[0])


def _recount() -> None:
    global _ANY
    _ANY = bool(_TABLE)
