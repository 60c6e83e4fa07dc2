"""Merge benchmark: ster_dist's streaming LoRA merge against a plain copy of the same files (GB/s
written) and against PEFT's merge_and_unload() + save_pretrained() (seconds and peak RSS).

    python bench/merge.py --quick                 # hidden 512, 4 layers: about a minute
    python bench/merge.py                         # hidden 1024, 8 layers, f32 (~550 MB): a few
    minutes python bench/merge.py --dtype bf16 --model-dir /tmp/llama-merge

Each measured run is its own fresh process (`python bench/merge.py child ...`), with the page
cache warmed first and the peak RSS read from VmHWM reset after the imports, so one run's memory
never shows in another's. The plain copy reads and writes every weight file and fsyncs it, as the
merge fsyncs each shard: the ratio is what merging costs over moving the bytes at all. Every
figure is the best of --repeats (PEFT's run once: it is the slow one). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, LlamaShape, ensure_checkpoint, warm_page_cache

GB = 1e9
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base: Path, directory: Path, rank: int, dtype: torch.dtype) -> None:
    """A PEFT LoRA adapter on every projection of every layer, with random factors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1)
    factors = {}
    for path in sorted(base.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = f.keys()
            for name in names:
                if name.endswith(".weight") and any(f".{t}." in name for t in TARGETS):
                    out, inp = f.get_slice(name).get_shape()
                    module = name[: -len(".weight")]
                    factors[f"base_model.model.{module}.lora_A.weight"] = (
                        torch.randn(rank, inp, generator=gen) * 0.01
                    ).to(dtype)
                    factors[f"base_model.model.{module}.lora_B.weight"] = (
                        torch.randn(out, rank, generator=gen) * 0.01
                    ).to(dtype)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(factors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": TARGETS,
                "bias": "none",
                "base_model_name_or_path": str(base),
                "task_type": "CAUSAL_LM",
            }
        )
    )


# ---- one measured run, in a fresh process ------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _child(engine: str, base: Path, adapter: Path, out: Path, dtype: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    if engine == "ster":
        from ster_dist.adapters.merge import merge
    elif engine == "peft":
        import transformers
        from peft import PeftModel
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark from here on
    before = _status("VmRSS")
    start = time.perf_counter()
    if engine == "ster":
        merge(str(base), str(adapter), out)
    elif engine == "peft":
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=DTYPES[dtype])
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        merged.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    else:  # a plain copy of the weight files, fsynced like the merge's shards
        out.mkdir(parents=True)
        for path in sorted(base.glob("*.safetensors")):
            shutil.copyfile(path, out / path.name)
            fd = os.open(out / path.name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    seconds = time.perf_counter() - start
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {
        "engine": engine,
        "seconds": seconds,
        "bytes_written": written,
        "gb_s": written / seconds / GB,
        "rss_growth_mb": (_status("VmHWM") - before) / 2**20,
    }


def run_child(engine: str, base: Path, adapter: Path, work: Path, dtype: str, threads: int) -> dict:
    out = work / f"out-{engine}"
    shutil.rmtree(out, ignore_errors=True)
    warm_page_cache(base)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "child",
        engine,
        str(base),
        str(adapter),
        str(out),
        "--dtype",
        dtype,
        "--threads",
        str(threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "child":
        p = argparse.ArgumentParser()
        p.add_argument("engine", choices=("ster", "peft", "copy"))
        p.add_argument("base", type=Path)
        p.add_argument("adapter", type=Path)
        p.add_argument("out", type=Path)
        p.add_argument("--dtype", default="f32")
        p.add_argument("--threads", type=int, default=2)
        a = p.parse_args(argv[1:])
        print(json.dumps(_child(a.engine, a.base, a.adapter, a.out, a.dtype, a.threads)))
        return
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="f32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="reuse (or build) the base checkpoint here"
    )
    parser.add_argument("--quick", action="store_true", help="hidden 512, 4 layers, 2 repeats")
    parser.add_argument("--skip-peft", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.repeats = 512, 4, 2
    work = Path(tempfile.mkdtemp(prefix="bench-merge-"))
    try:
        base = args.model_dir or work / "base"
        ensure_checkpoint(base, LlamaShape.scaled(args.hidden, args.layers), DTYPES[args.dtype])
        adapter = work / "adapter"
        write_adapter(base, adapter, args.rank, DTYPES[args.dtype])
        size = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        load = os.getloadavg()[0]
        runs: dict[str, list[dict]] = {"copy": [], "ster": [], "peft": []}
        for _ in range(args.repeats):  # alternate, so load from other processes hits both alike
            for engine in ("copy", "ster"):
                runs[engine].append(
                    run_child(engine, base, adapter, work, args.dtype, args.threads)
                )
        if not args.skip_peft:
            runs["peft"].append(run_child("peft", base, adapter, work, args.dtype, args.threads))
        best = {e: min(r, key=lambda x: x["seconds"]) for e, r in runs.items() if r}
        peak = {e: min(x["rss_growth_mb"] for x in r) for e, r in runs.items() if r}
        print(
            f"checkpoint: {size / GB:.3f} GB ({args.dtype}, hidden {args.hidden}, {args.layers} layers), "
            f"adapter rank {args.rank} on all 7 projections; load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        print(f"{'':22}{'seconds':>10}{'GB/s written':>14}{'peak RSS growth MB':>20}")
        for engine, label in (
            ("copy", "plain copy (fsync)"),
            ("ster", "ster_dist merge"),
            ("peft", "PEFT merge+save"),
        ):
            if engine in best:
                b = best[engine]
                print(f"{label:22}{b['seconds']:>10.2f}{b['gb_s']:>14.3f}{peak[engine]:>20.0f}")
        ratios = {"ster_over_copy_gb_s": best["ster"]["gb_s"] / best["copy"]["gb_s"]}
        if "peft" in best:
            ratios.update(
                peft_over_ster_seconds=best["peft"]["seconds"] / best["ster"]["seconds"],
                peft_over_ster_peak_rss=peak["peft"] / max(peak["ster"], 1e-9),
            )
        print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
        print(
            json.dumps(
                {
                    "checkpoint_bytes": size,
                    "dtype": args.dtype,
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "rank": args.rank,
                    "best": best,
                    "peak_rss_growth_mb": peak,
                    "ratios": ratios,
                    "runs": runs,
                    "load_average": load,
                }
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
