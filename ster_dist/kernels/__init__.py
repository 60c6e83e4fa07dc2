"""Kernels of our own, in C++ for the CPU, where torch's are slow on the shapes of a decode step:

- `few_rows(x, weight, bias)` (few_rows.cpp): x W^T (+ b) for one to eight rows of f32 or bf16
  (dense() in parallel/linear.py sends those rows here).
- `paged_decode(q, keys, values, table, starts, ends, scale, softcap=0)` (paged_decode.cpp): one
  query per sequence attending its keys where they lie in a paged cache, each score soft-capped
  where a cap is given (model/paged_step.py's decodes).
- `causal_attend(q, keys, values, table, starts, window, scale, softcap=0)` (causal_attend.cpp): a
  prompt's queries attending the keys before them (within a window, each score soft-capped where a
  cap is given) where a cache holds them (model/paged_step.py's and model/step.py's prefills).
- `swiglu_experts(x, ids, gate, up, down)` (experts.cpp): rows through their SwiGLU experts, eight
  of an expert's rows at a time (moe/experts.py's decodes and, in bf16 or up to 512 rows, prefills;
  eager or inside a compiled step).
- `pack_panels(weight, out)`, `panel_bytes(weight)`, `panel_product(x, panels, bias, N)`
  (panels.cpp): a weight laid out in panels of 32 outputs (16 with AVX2; into `out` where given),
  the bytes that takes, and x W^T (+ b) over it for any number of rows (f32; bf16 with AVX512_BF16
  or with AVX2 alone);
  `hold_panels(weight, panels)`,
  `hold_onednn(weight, reordered, widened)`, `drop_held(address)` and `packed_product(x, weight,
  bias)`: the packed weights of parallel/packed.py (panels, or oneDNN's reorder where there are
  none), found by the weight itself.
- `push_plan(...)`, `attend_planned(q, k, v, layer)`, `pop_plan()` (paged_decode.cpp): a compiled
  decode step's attention stored and computed without calling back into Python each layer, each
  layer within its sliding window or chunk and under its soft cap where it has one
  (model/compiled.py).
- `stack_step(h, weights, layers, numbers, shape, cos, sin, rotations)` (stack.cpp): a decode step
  through plain Llama- or Gemma-shaped layers in one call, over the plan pushed
  (model/native_stack.py);
  `stack_lanes()`: the
  floats a vector of its loops, which must be inductor's for the graph's bits.
- `block_product(x, weight, bias, kind, cols)` (blocks.cpp): x W^T (+ b) for 1 to 64 rows over a
  weight kept in GGML blocks (Q8_0, Q4_0, Q4_1; parallel/ggml.py), x quantized to 8 bits per block
  as llama.cpp does.
- `argmax_rows(x)` (argmax.cpp): each row's first largest element, as torch.argmax(x, -1) picks it
  (`argmax` below: what greedy steps and the sampler pick tokens with).

They are compiled together, for the CPU they run on, the first time a process needs one (torch's
extension builder with the compiler torch.compile uses; 15-30 s once, then loaded from the build
cache in a fraction of a second, by any copy of the same sources: `_build_or_find`), and called as
torch.ops.ster_kernels.*. Where they cannot be built (no compiler, no AVX2) one line on stderr says
so and callers keep torch's own operations. STER_NATIVE_KERNELS=0 leaves them out;
STER_KERNELS_ISA=avx2 builds their AVX2 loops on a CPU with AVX-512 (what
tests/kernels/test_kernels_avx2.py checks them with there; native steps then stay off, their loops
no longer inductor's width).

`ready()` is what callers ask: it builds on the first eager call and, inside a graph being traced,
answers what an eager call already found (model/compiled.py asks once before it compiles), so
tracing never builds.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from ster_dist.events import progress

# up to 8 rows the kernel beat oneDNN's matmul (f32) and F.linear (bf16) on every one of SmolLM2's
# shapes here
# (at 8: 1.1-1.8x in f32, 1.1-1.7x in bf16); from about 10 rows, compute rather than reading the
# weight
# bounds a product and the library's blocked kernels are ahead
FEW_ROWS_MAX = 8
SOURCES = (
    "few_rows.cpp",
    "paged_decode.cpp",
    "causal_attend.cpp",
    "experts.cpp",
    "panels.cpp",
    "argmax.cpp",
    "stack.cpp",
    "blocks.cpp",
)

_tried = False
_ready = False
_held: tuple[bool, bool] | None = None  # (_tried, _ready) while --kernels torch holds them off
_panels = 0  # the dtypes panels.cpp was built for: 1 f32, 2 bf16 (bits)


def ready() -> bool:
    """Whether torch.ops.ster_kernels.* can be called (built and loaded, for AVX2 or AVX-512)."""
    if torch.compiler.is_compiling():
        return _ready
    return _ready if _tried else _load()


def allow(allowed: bool) -> None:
    """Let callers use these kernels (the default) or not (`--kernels torch`: torch's operations
    only, kernels/select.py); allowing again restores what loading found."""
    global _tried, _ready, _held
    if not allowed and _held is None:
        _held = (_tried, _ready)
        _tried, _ready = True, False
    elif allowed and _held is not None:
        (_tried, _ready), _held = _held, None


def panels(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` can be laid out in panels and multiplied there (panels.cpp: f32
    with AVX2 or AVX-512; bf16 with AVX512_BF16, or with AVX2 on a CPU without AVX-512)."""
    # compared, not looked up in a table keyed by dtype: a graph that reuses one layer's region for the next
    # (the one-token stack, model/compiled.py) cannot rebuild a guard on such a table's entry
    bit = 1 if dtype == torch.float32 else 2 if dtype == torch.bfloat16 else 0
    return ready() and bool(_panels & bit)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1), the same indices (the first largest, or the first NaN), through
    argmax.cpp where it takes x: torch's CPU argmax over a 49152-token vocabulary took 42 us a row
    in f32 and 177 us in bf16."""
    if (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() >= 1
        and x.shape[-1] > 0
        and not x.requires_grad
        and ready()
    ):
        return torch.ops.ster_kernels.argmax_rows(x)
    return x.argmax(-1)


def _load() -> bool:
    global _tried, _ready, _panels
    _tried = True
    if os.environ.get("STER_NATIVE_KERNELS") == "0":
        return False
    started = time.perf_counter()
    try:
        asked = os.environ.get("STER_KERNELS_ISA", "native")
        if asked not in ("native", "avx2"):
            progress(
                f"STER_KERNELS_ISA={asked!r} is not 'native' or 'avx2': the kernels are built for this CPU"
            )
        _build_or_find(avx2=asked == "avx2")
        _ready = torch.ops.ster_kernels.isa() > 0
        _panels = torch.ops.ster_kernels.panel_dtypes()
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as error:
        lines = str(error).strip().splitlines() or [type(error).__name__]
        said = next(
            (line for line in lines if "error" in line.lower() and line != lines[0]), lines[0]
        )
        progress(
            f"ster_dist's CPU kernels could not be built ({said.strip()[:200]}); "
            "decode steps use torch's own operations"
        )
        return False
    if not _ready:
        progress("this CPU has neither AVX2 nor AVX-512: decode steps use torch's own operations")
        return False
    torch.library.register_fake("ster_kernels::few_rows")(_product_shape)
    torch.library.register_fake("ster_kernels::packed_product")(_product_shape)
    torch.library.register_fake("ster_kernels::paged_decode")(_attention_shape)
    torch.library.register_fake("ster_kernels::attend_planned")(_planned_shape)
    torch.library.register_fake("ster_kernels::causal_attend")(_causal_shape)
    torch.library.register_fake("ster_kernels::swiglu_experts")(_experts_shape)
    torch.library.register_fake("ster_kernels::block_product")(_block_shape)
    if (spent := time.perf_counter() - started) > 2:
        progress(
            f"built ster_dist's CPU kernels for this CPU in {spent:.0f} s (kept in torch's extension cache)"
        )
    return True


def _build_or_find(avx2: bool) -> None:
    """Loads the build of these sources for this CPU, building it first where none is finished.

    The build is named by what it is made of (the sources' bytes, the flags, this CPU, torch and
    Python), not by where the sources lie, and built from a copy of them beside it: a copy of the
    package elsewhere (a Ray job's uploaded working directory, a second clone) finds the same build
    rather than rebuilding over it, and two versions of the sources never share a build directory. A
    finished build is loaded without running the builder, whose ninja (PATH's, which differs between
    a virtualenv and the system) would otherwise rebuild everything over a log another ninja wrote.
    Builders take turns under a lock the kernel drops with its holder, so one killed mid-build (a
    rank killed, a job past its timeout) leaves nothing that later ones wait on."""
    from torch.utils.cpp_extension import load

    directory = build_directory(avx2)
    name, files, cflags = directory.name, _files(), _cflags(avx2)
    if _load_finished(directory):
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "building", "a") as guard:
        # one builder at a time, under a lock the kernel drops when its holder dies, however it
        # dies; torch's own
        # (a file it deletes when done) stays behind a builder killed mid-build and every later
        # build waited on it
        # forever
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(
                f"another process is building ster_dist's CPU kernels in {directory}; waiting for it"
            )
            fcntl.flock(guard, fcntl.LOCK_EX)
        if _load_finished(directory):  # built while this process waited
            return
        # torch's, and no builder holds this directory: stale
        (directory / "lock").unlink(missing_ok=True)
        progress(
            f"building ster_dist's CPU kernels for this CPU into {directory} (once; "
            f"{build_estimate(directory.parent)})"
        )
        started = time.perf_counter()
        sources = directory / "sources"
        sources.mkdir(exist_ok=True)
        # the same bytes whoever writes them; renamed in, so no build reads half a file
        for path in files:
            if not (sources / path.name).is_file():
                temporary = sources / f".{path.name}.{os.getpid()}"
                temporary.write_bytes(path.read_bytes())
                temporary.replace(sources / path.name)
        load(
            name=name,
            sources=[str(sources / file) for file in SOURCES],
            extra_include_paths=[str(sources)],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
        # after the library is whole and loaded: seen, it is loaded directly; it holds how long the
        # build took, which the next build's estimate reads (build_estimate), renamed in whole
        finished = directory / f".finished.{os.getpid()}"
        finished.write_text(f"{time.perf_counter() - started:.1f}\n")
        finished.replace(directory / "finished")


def build_estimate(root: Path) -> str:
    """How long a build will take, as the last finished build under `root` took (its `finished`
    file holds its seconds): measured on this machine, under whatever else it was running then."""
    last = None
    for finished in root.glob("ster_kernels_*/finished"):
        try:
            seconds, when = float(finished.read_text().strip()), finished.stat().st_mtime
        except (OSError, ValueError):  # a build finished before its time was recorded
            continue
        if last is None or when > last[0]:
            last = (when, seconds)
    if last is None:
        return "no earlier build here was timed"
    return f"the last build here took {last[1]:.0f} s"


def _load_finished(directory: Path) -> bool:
    """Loads the build in `directory` if it is finished (its library whole); whether it did."""
    library = directory / f"{directory.name}.so"
    if not ((directory / "finished").is_file() and library.is_file()):
        return False
    torch.ops.load_library(str(library))
    return True


def build_directory(avx2: bool = False) -> Path:
    """Where the build of these sources for this CPU lies, or will: named by a hash of what it is
    made of."""
    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha256(
        "\0".join([_cpu_described(), torch.__version__, sys.version, *_cflags(avx2)]).encode()
    )
    for path in _files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"ster_kernels_{digest.hexdigest()[:16]}"


def _files() -> list[Path]:
    here = Path(__file__).parent
    return sorted(here.glob("*.cpp")) + sorted(here.glob("*.h"))


def _cflags(avx2: bool) -> list[str]:
    return ["-O3", "-march=native", *(["-mno-avx512f"] if avx2 else []), "-fopenmp"]


def _product_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _block_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: int, cols: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _experts_shape(
    x: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    return x.new_empty((x.shape[0], down.shape[1]))


def _attention_shape(
    q, keys, values, table, starts, ends, scale: float, softcap: float = 0.0
) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], values.shape[3]))


def _causal_shape(
    q, keys, values, table, starts, window: int, scale: float, softcap: float = 0.0
) -> torch.Tensor:
    return q.new_empty((*q.shape[:3], values.shape[3]))


def _planned_shape(q, k, v, layer) -> torch.Tensor:
    return q.new_empty((*q.shape[:3], v.shape[-1]))


def _cpu_described() -> str:
    # the build is for this CPU's instructions (-march=native): a cache shared by machines of other
    # CPUs
    # (a home directory on a network disk) must not hand one machine another's build
    try:
        with open("/proc/cpuinfo") as f:
            described = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        described = ""
    return described + platform.machine() + platform.processor()
