"""Helpers shared by the benchmarks in bench/: random checkpoints, timing, bandwidth, child-process
loads.

Nothing here measures ster_dist against anything by itself; each bench/*.py script composes
these pieces and prints its own table. The module is also a small command line used by the
benchmarks to load a model in a fresh process (so one load's memory never pollutes another's):

    python bench/common.py load --engine ster|hf --model-dir DIR --dtype f32|bf16 --threads 2

prints one JSON line {"load_s", "rss_before_mb", "rss_peak_mb", "rss_growth_mb", "rss_after_mb",
...} (peak = the VmHWM high-water mark, reset just before the load; see _child_load for why not
ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # so `import ster_dist` works when run as `python bench/x.py`
    sys.path.insert(0, str(REPO))

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
MB = 1024 * 1024


# ---- threads and timing ----------------------------------------------------------------------


def set_threads(threads: int) -> None:
    """The same intra-op thread count for every engine measured in this process."""
    torch.set_num_threads(threads)


def best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The fastest of `repeats` timed calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# ---- memory bandwidth ------------------------------------------------------------------------


def copy_bandwidth(nbytes: int = 256 * MB, repeats: int = 10) -> float:
    """Memory bytes per second moved by dst.copy_(src) into an already-touched buffer, best of
    `repeats`.

    Counted as bytes read + bytes written (2 x the buffer over the time), the convention of
    /work/shared/ENV-NOTES.md (about 23.5 GB/s on 2 threads). Measured here, that figure
    matches a pure read (a sum over the buffer) and a large matrix-vector product within
    about 10%, so it stands for the read bandwidth a decode step's weight stream gets.
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first: a fresh buffer measures page faults, not memory
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), repeats)


def gemv_bandwidth(dtype: torch.dtype, dim: int = 4096, repeats: int = 20) -> float:
    """Weight bytes per second of one [dim, dim] matrix times a vector: a decode step's kernel."""
    weight = torch.randn(dim, dim).to(dtype)
    x = torch.randn(1, dim).to(dtype)
    with torch.inference_mode():
        seconds = best_seconds(lambda: torch.nn.functional.linear(x, weight), repeats, warmup=3)
    return weight.numel() * weight.element_size() / seconds


# ---- random checkpoints ----------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 1024
    layers: int = 16
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 2816
    vocab: int = 32000
    max_position: int = 2048

    @staticmethod
    def scaled(hidden: int, layers: int, vocab: int = 32000) -> LlamaShape:
        """Llama proportions for a width: 64-wide heads, 4 query heads per KV head, FFN 2.75x."""
        heads = max(1, hidden // 64)
        return LlamaShape(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=max(1, heads // 4),
            intermediate=round(hidden * 2.75 / 64) * 64,
            vocab=vocab,
        )


def write_wordlevel_tokenizer(directory: Path, vocab: int) -> None:
    """A minimal tokenizers-format tokenizer.json (WordLevel, whitespace split) of `vocab` entries.

    resolve() requires a tokenizer.json beside the config; these benchmarks feed token ids
    directly, so any valid tokenizer of the right size does.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def build_llama_checkpoint(
    directory: Path, shape: LlamaShape, dtype: torch.dtype, seed: int = 0
) -> None:
    """A randomly initialised LlamaForCausalLM saved as safetensors, with no EOS token.

    bos/eos/pad ids are None so neither engine stops early: every run decodes exactly
    the number of tokens asked for.
    """
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_position,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(directory, safe_serialization=True)
    write_wordlevel_tokenizer(directory, shape.vocab)
    (directory / "bench_shape.json").write_text(json.dumps({**asdict(shape), "dtype": str(dtype)}))
    del model


def ensure_checkpoint(directory: Path, shape: LlamaShape, dtype: torch.dtype) -> bool:
    """Build the checkpoint unless `directory` already holds one; True when it was built now."""
    if (directory / "config.json").is_file() and any(directory.glob("*.safetensors")):
        if not (directory / "tokenizer.json").is_file():
            write_wordlevel_tokenizer(
                directory, json.loads((directory / "config.json").read_text())["vocab_size"]
            )
        return False
    build_llama_checkpoint(directory, shape, dtype)
    return True


def warm_page_cache(directory: Path) -> None:
    """Read every weight file once, so both engines' loads start from a warm page cache."""
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(64 * MB):
                pass


# ---- loading, in this process or a fresh one -------------------------------------------------


def load_ster(model_dir: Path, precision: str):
    """ster_dist's load path: resolve + load_model. Returns the LoadedModel."""
    from ster_dist.load import load_model
    from ster_dist.resolve import resolve

    return load_model(resolve(str(model_dir)), precision, "cpu")


def load_hf(model_dir: Path, precision: str):
    """Transformers' load path: AutoModelForCausalLM.from_pretrained in the precision's dtype."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[precision])
    return model.eval()


def _status_mb(field: str) -> float:
    """A kB field of /proc/self/status (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _child_load(engine: str, model_dir: Path, precision: str, threads: int) -> dict:
    """Runs in the child: import everything first, then time and measure only the load."""
    set_threads(threads)
    if engine == "ster":
        import ster_dist.load
        import ster_dist.resolve  # noqa: F401

        load = load_ster
    else:
        import transformers.models.llama.modeling_llama  # noqa: F401  (the lazy import is not load time)
        from transformers import AutoModelForCausalLM  # noqa: F401

        load = load_hf
    # getrusage's ru_maxrss is the figure to use in principle, but Linux carries the parent's
    # high-water mark into the child across fork + exec (a child of a 460 MB parent starts at
    # ru_maxrss 460 MB), so a load smaller than the parent reads as zero growth. This process's
    # own mm high-water mark (VmHWM), reset just before the load, has no such inheritance.
    hwm = _reset_peak_rss()
    before = _status_mb("VmRSS") if hwm else _maxrss_mb()
    maxrss_before = _maxrss_mb()
    start = time.perf_counter()
    model = load(model_dir, precision)
    seconds = time.perf_counter() - start
    peak = _status_mb("VmHWM") if hwm else _maxrss_mb()
    after = _status_mb("VmRSS")
    maxrss_after = _maxrss_mb()
    # A load may leave weights as lazy views of the memory-mapped file (Transformers does when
    # the file's dtype is the one asked for): nothing is read until the first forward. Reading
    # every parameter once, outside the clock, shows the resident size of a model ready to run.
    touch_start = time.perf_counter()
    with torch.inference_mode():
        module = model.model if engine == "ster" else model  # LoadedModel.model is the Decoder
        for p in module.parameters():
            p.float().sum() if p.dtype != torch.float32 else p.sum()
    touch_s = time.perf_counter() - touch_start
    touched_peak = _status_mb("VmHWM") if hwm else _maxrss_mb()
    touched = _status_mb("VmRSS")
    del model
    return {
        "load_s": seconds,
        "rss_before_mb": before,
        "rss_peak_mb": peak,
        "rss_growth_mb": peak - before,
        "rss_after_mb": after,
        "peak_source": "VmHWM" if hwm else "ru_maxrss",
        "ru_maxrss_before_mb": maxrss_before,
        "ru_maxrss_after_mb": maxrss_after,
        "touch_s": touch_s,
        "touched_rss_mb": touched,
        "touched_peak_growth_mb": touched_peak - before,
    }


def load_in_child(engine: str, model_dir: Path, precision: str, threads: int) -> dict:
    """Load one engine's model in a fresh Python process; its load time and peak-RSS growth."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "load",
        "--engine",
        engine,
        "--model-dir",
        str(model_dir),
        "--dtype",
        precision,
        "--threads",
        str(threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"child load of {engine} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="load a model once and print load seconds and RSS as JSON")
    load.add_argument("--engine", choices=("ster", "hf"), required=True)
    load.add_argument("--model-dir", type=Path, required=True)
    load.add_argument("--dtype", choices=tuple(DTYPES), default="f32")
    load.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(_child_load(args.engine, args.model_dir, args.dtype, args.threads)))


if __name__ == "__main__":
    _main()
