"""Products of one to seven rows on a CPU (decode steps) through a kernel of our own, few_rows.cpp.

The kernel is compiled for the CPU it runs on the first time a process needs it (torch's extension builder,
the compiler torch.compile uses; about 30 s once, then loaded from the build cache in a fraction of a second).
Where it cannot be built (no compiler, no AVX2) one line on stderr says so and dense() keeps the library's
products. STER_NATIVE_KERNELS=0 leaves it out.

`ready()` is what dense() asks: it builds on the first eager call and, inside a graph being traced, answers
what an eager call already found (model/compiled.py asks once before it compiles), so tracing never builds.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from ster_dist.events import progress

MAX_ROWS = 7  # from 8 rows oneDNN's matmul (f32) and F.linear (bf16) are at least as fast (bench/decode.py)

_tried = False
_ready = False


def ready() -> bool:
    """Whether torch.ops.ster_few_rows.few_rows can be called (built and loaded, for AVX2 or AVX-512)."""
    if torch.compiler.is_compiling():
        return _ready
    return _ready if _tried else _load()


def _load() -> bool:
    global _tried, _ready
    _tried = True
    if os.environ.get("STER_NATIVE_KERNELS") == "0":
        return False
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        load(name=f"ster_few_rows_{_cpu_key()}", sources=[str(Path(__file__).with_name("few_rows.cpp"))],
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
        _ready = torch.ops.ster_few_rows.isa() > 0
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as error:
        lines = str(error).strip().splitlines() or [type(error).__name__]
        said = next((line for line in lines if "error" in line.lower() and line != lines[0]), lines[0])
        progress(f"the few-row product kernel could not be built ({said.strip()[:200]}); "
                 "decode steps use the library's products")
        return False
    if not _ready:
        progress("this CPU has neither AVX2 nor AVX-512: decode steps use the library's products")
        return False
    torch.library.register_fake("ster_few_rows::few_rows")(_shape)
    if (spent := time.perf_counter() - started) > 2:
        progress(f"built the few-row product kernel for this CPU in {spent:.0f} s (kept in torch's extension cache)")
    return True


def _shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _cpu_key() -> str:
    # the build is for this CPU's instructions (-march=native): a cache shared by machines of other CPUs
    # (a home directory on a network disk) must not hand one machine another's build
    try:
        with open("/proc/cpuinfo") as f:
            described = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        described = ""
    described += platform.machine() + platform.processor()
    return hashlib.sha256(described.encode()).hexdigest()[:12]
