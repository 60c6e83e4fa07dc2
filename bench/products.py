"""The products of a decode step, one kernel against another: which one a row count should take on
this CPU.

A decode step reads every projection weight once. This script lays out SmolLM2-135M's shapes (30
layers of fused q/k/v, o, fused gate/up and down, then the 49152-token head: 538 MB of f32 weights,
far beyond any cache), random, and times one pass over all of them, x of `rows` rows, through each
kernel that can take that row count here. The kernels alternate, each pass in a rotated order, so
the machine's drift hits them alike; each figure is the median of
`--passes` passes. Printed: ms a pass and GB/s of weights read, then each kernel's time over the one
`parallel/linear.py`'s dense() picks for that row count with an engine's packed weights (ratios
above 1: slower than dense()'s pick).

    python bench/products.py                       # f32, rows 1 2 4 8 12 16 32
    python bench/products.py --dtype bf16 --rows 1 8 12 16

Kernels (each where this CPU and torch have it):
  few_rows        kernels/few_rows.cpp on the plain weight (1-8 rows)
  panels          kernels/panels.cpp over the weight packed in panels (AVX-512; bf16 with
  AVX512_BF16)
  onednn_packed   oneDNN's matmul over the weight reordered once (mkldnn._reorder_linear_weight)
  onednn          oneDNN's matmul over the plain weight
  linear          F.linear (MKL or torch's own kernel)
  upcast          bf16 as f32 over a widened copy of the weight, a block at a time (linear.py's
  _upcast)
  dense           what dense() runs with the engine's packed weights (parallel/packed.py), as a
  token engine does
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (puts the repository on sys.path)

from ster_dist import kernels  # noqa: E402
from ster_dist.engine.runner import pack_all  # noqa: E402
from ster_dist.parallel import linear, packed  # noqa: E402

# SmolLM2-135M: hidden 576, 9 heads and 3 key/value heads of 64, intermediate 1536, 30 layers,
# vocabulary 49152
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD = (49152, 576)


def weights(dtype: torch.dtype, layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(layers) for s in LAYER_SHAPES] + [HEAD]
    return [(torch.randn(shape, generator=g) * 0.02).to(dtype) for shape in shapes]


def kernel_table(
    dtype: torch.dtype, rows: int, plain: list[torch.Tensor], reordered: list[torch.Tensor] | None
):
    """name -> one pass over every weight, for the kernels that can take `rows` rows of `dtype`
    here."""
    inner = {w.shape[1] for w in plain}
    xs = {k: torch.randn(rows, k).to(dtype) for k in inner}
    table = {}
    if rows <= kernels.FEW_ROWS_MAX and kernels.ready():
        table["few_rows"] = lambda: [
            torch.ops.ster_kernels.few_rows(xs[w.shape[1]], w, None) for w in plain
        ]
    if reordered is not None:
        table["onednn_packed"] = lambda: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], r, None, "none", [], "")
            for w, r in zip(plain, reordered)
        ]
    if packed._onednn(dtype):
        table["onednn"] = lambda: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], w, None, "none", [], "")
            for w in plain
        ]
    table["linear"] = lambda: [F.linear(xs[w.shape[1]], w) for w in plain]
    if dtype != torch.float32:
        table["upcast"] = lambda: [linear._upcast(xs[w.shape[1]], w, None) for w in plain]
    table["dense"] = lambda: [linear.dense(xs[w.shape[1]], w) for w in plain]
    return table


def measure(table: dict, passes: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in table}
    for fn in table.values():  # warm-up: first-touch pages, oneDNN's primitive caches
        fn()
    names = list(table)
    for n in range(passes):  # each pass starts one kernel later: none always follows the same one
        for name in names[n % len(names) :] + names[: n % len(names)]:
            fn = table[name]
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default="f32")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    dtype = common.DTYPES[args.dtype]
    kernels.ready()  # build or load the package's kernels before any clock
    plain = weights(dtype, args.layers)
    nbytes = sum(w.nbytes for w in plain)
    reordered = (
        [torch.ops.mkldnn._reorder_linear_weight(w, packed.PACKING_ROWS) for w in plain]
        if packed._onednn(dtype)
        else None
    )
    # as a token engine packs them: panels where the CPU has them, else oneDNN's reorder
    pack_all([w for w in plain if packed.packable(w)])
    print(
        f"{len(plain)} weights, {nbytes / 1e6:.0f} MB of {args.dtype}, {args.threads} threads, cpu capability "
        f"{torch.backends.cpu.get_cpu_capability()}, panels {kernels.panels(dtype)}, "
        f"native half products {packed.NATIVE_HALF_PRODUCTS}; median of {args.passes} alternating passes"
    )
    for rows in args.rows:
        table = kernel_table(dtype, rows, plain, reordered)
        if kernels.panels(dtype):
            xs = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in plain}}
            table["panels"] = lambda xs=xs: [
                torch.ops.ster_kernels.packed_product(xs[w.shape[1]], w, None) for w in plain
            ]
        got = measure(table, args.passes)
        base = got["dense"]
        cells = "  ".join(
            f"{name} {t * 1e3:.1f} ms {nbytes / t / 1e9:.1f} GB/s ({t / base:.2f}x)"
            for name, t in sorted(got.items(), key=lambda kv: kv[1])
        )
        print(f"rows {rows:4d}: {cells}")
    packed.release(plain)


if __name__ == "__main__":
    main()
