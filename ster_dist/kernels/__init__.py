"""CPU kernels of ster_dist's own, built once from their C++ source and cached.

`matrix_vector(x, W)` (matrix_vector.cpp) is x W^T for 1 to 4 rows of x: a decode step's products. It is built
by torch's extension builder (as DeepSpeed builds its ops) the first time a model is loaded on a CPU with AVX2
and FMA, into ~/.cache/ster_dist/kernels/<key> (STER_KERNELS_CACHE moves it), the key hashing the source, the
flags and torch's version; later processes only load the built library. Where it cannot be built (no
compiler, another CPU) or STER_KERNELS=0 is set, products run through torch as before; `status()` says which.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from ster_dist.events import progress

SOURCE = Path(__file__).with_name("matrix_vector.cpp")
FLAGS = ("-O3", "-mavx2", "-mfma")
NAME = "ster_matrix_vector"
ROWS_MAX = 4  # rows of x the kernel takes; more go to torch's products

_why_not: str | None = "not prepared"  # None once the kernel is loaded


def _cache_dir() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode())
    root = os.environ.get("STER_KERNELS_CACHE") or Path.home() / ".cache" / "ster_dist" / "kernels"
    return Path(root) / key.hexdigest()[:16]


def prepare() -> str | None:
    """Load the kernel, building it first if no build is cached. Returns why it is not used (None: it is)."""
    global _why_not
    if _why_not is None or _why_not.startswith("could not"):
        return _why_not  # loaded, or a build already failed in this process: not tried again
    if os.environ.get("STER_KERNELS") == "0":
        _why_not = "STER_KERNELS=0 is set"
        return _why_not
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _why_not = "this CPU lacks AVX2 and FMA"
        return _why_not
    directory = _cache_dir()
    built = directory / f"{NAME}.so"
    try:
        if built.is_file():
            torch.ops.load_library(str(built))
        else:
            _build(directory)
        torch.library.register_fake("ster_kernels::matrix_vector")(_fake)
    except Exception as error:  # noqa: BLE001 - any build failure means torch's products, said once
        _why_not = f"could not build ster_dist's matrix-vector kernel ({str(error).strip().splitlines()[-1]})"
        progress(f"{_why_not}; products run through torch")
        return _why_not
    _why_not = None
    return None


def _build(directory: Path) -> None:
    from torch.utils.cpp_extension import load  # imported only to build: it is slow to import

    directory.mkdir(parents=True, exist_ok=True)
    progress(f"building ster_dist's matrix-vector kernel for this CPU into {directory} (once; about a minute)")
    load(name=NAME, sources=[str(SOURCE)], extra_cflags=list(FLAGS), build_directory=str(directory),
         is_python_module=False, verbose=False)


def ready() -> bool:
    return _why_not is None


def status() -> str:
    return "ster_dist's matrix-vector kernel" if _why_not is None else f"torch's products ({_why_not})"


def _fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # its output's shape, for a compiled step (model/compiled.py) that traces through the kernel
    return x.new_empty((x.shape[0], weight.shape[0]))
