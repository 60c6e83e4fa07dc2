"""FP8 weights kept (`--weights fp8`) against dequantized (`--weights dequantize`), and an FP8
checkpoint's per-rank load against its BF16 twin.

One random Llama checkpoint in BF16 is written, and its FP8 twin: every projection quantized in
blocks of
--block x --block as DeepSeek-V3 publishes (float8_e4m3fn beside `<name>_scale_inv`, one float32
scale a block); norms, embeddings and head stay BF16. Then:

  load     each run in a fresh Python process (no shared pages), at tp 1 and tp 2 (two spawned ranks
  on
           gloo; the figures are the slower rank's): the BF16 twin, the FP8 checkpoint dequantized
           to
           --dtype, the FP8 checkpoint kept in FP8. Seconds, peak-RSS growth (VmHWM reset before the
           load, over the RSS after imports), bytes read per rank and bytes held per rank
           (parameters and scale buffers), each as a ratio to the BF16 twin's.
  decode   in this process: batch-1 greedy decode steps (after a --prompt-len prompt, as
           bench/decode.py drives the Decoder) with the FP8 checkpoint dequantized and kept, at
           --dtype; tokens/s of each and kept / dequantized. On a CPU the kept model dequantizes
           each matrix for each product (parallel/fp8.py), so it trades speed for memory there; on
           an SM90 GPU with blockwise scaled_mm it multiplies in FP8.

Nothing here is asserted; the ratios are printed, and the last line is the JSON of every figure.

    python bench/fp8.py [--hidden 1024 --layers 8 --threads 2 --dtype bf16 --new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time
import torch
from ster_dist.load import load_model
from ster_dist.resolve import resolve
from ster_dist.workers.rank import peak_rss_bytes, reset_peak_rss
from ster_dist.workers.spawn import SpawnGroup
path, dtype, weights, tp, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
checkpoint = resolve(path)
if tp == 1:
    base = reset_peak_rss(); start = time.perf_counter()
    loaded = load_model(checkpoint, dtype, weights=weights)
    seconds, growth = time.perf_counter() - start, peak_rss_bytes() - base
    held = sum(t.numel() * t.element_size() for t in [*loaded.model.parameters(), *loaded.model.buffers()])
    out = {"seconds": seconds, "rss_growth": growth, "bytes_read": [loaded.bytes_read], "held": [held]}
else:
    with SpawnGroup(tp, threads=max(1, threads // tp)) as group:
        stats = group.call("load", checkpoint, dtype, "cpu", weights)
    out = {"seconds": max(s["load_seconds"] for s in stats),
           "rss_growth": max(s["peak_rss_after"] - s["peak_rss_before"] for s in stats),
           "bytes_read": [s["bytes_read"] for s in stats]}
print(json.dumps(out))
"""


def quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block), DeepSeek's scheme: scale = amax /
    448."""
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = torch.nn.functional.pad(w.float(), (0, nc * block - cols, 0, nr * block - rows))
    blocks = padded.reshape(nr, block, nc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return q.contiguous().to(torch.float8_e4m3fn), scale


def write_twins(root: Path, hidden: int, layers: int, block: int) -> tuple[Path, Path]:
    """The BF16 checkpoint and its FP8 twin."""
    import shutil

    from safetensors.torch import load_file, save_file

    from bench.common import LlamaShape, build_llama_checkpoint

    bf16, fp8 = root / "bf16", root / "fp8"
    build_llama_checkpoint(bf16, LlamaShape.scaled(hidden, layers), torch.bfloat16)
    fp8.mkdir()
    tensors = {}
    for path in sorted(bf16.glob("*.safetensors")):
        for name, t in load_file(str(path)).items():
            if name.endswith("proj.weight"):
                tensors[name], tensors[name + "_scale_inv"] = quantize(t, block)
            else:
                tensors[name] = t
    save_file(tensors, str(fp8 / "model.safetensors"))
    for path in bf16.iterdir():
        if (
            path.suffix != ".safetensors"
            and path.name != "model.safetensors.index.json"
            and path.is_file()
        ):
            shutil.copy(path, fp8 / path.name)
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [block, block],
        "activation_scheme": "dynamic",
    }
    (fp8 / "config.json").write_text(json.dumps(config))
    return bf16, fp8


def load_in_child(path: Path, dtype: str, weights: str, tp: int, threads: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), dtype, weights, str(tp), str(threads)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    if proc.returncode:
        raise RuntimeError(
            f"load of {path.name} ({weights}, tp {tp}) failed:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def decode_rate(
    path: Path, dtype: str, weights: str, prompt_len: int, new_tokens: int, repeats: int
) -> float:
    """Batch-1 greedy decode tokens/s (steps only, best of `repeats` per step position)."""
    from bench.decode import SterEngine, greedy
    from ster_dist.load import load_model
    from ster_dist.resolve import resolve

    engine = SterEngine(load_model(resolve(str(path)), dtype, weights=weights))
    prompt = torch.randint(3, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    greedy(engine, prompt, 2)  # warm-up
    best: list[float] | None = None
    for _ in range(repeats):
        _, _, steps = greedy(engine, prompt, new_tokens)
        best = steps if best is None else [min(a, b) for a, b in zip(best, steps)]
    return (new_tokens - 1) / sum(best)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        bf16, fp8 = write_twins(Path(tmp), args.hidden, args.layers, args.block)
        out["file_bytes"] = {
            p.name: sum(f.stat().st_size for f in p.glob("*.safetensors")) for p in (bf16, fp8)
        }
        sizes = out["file_bytes"]
        print(f"checkpoints: BF16 {sizes['bf16'] / 1e6:.0f} MB, FP8 {sizes['fp8'] / 1e6:.0f} MB")
        print(
            f"{'load':<28}{'s':>8}{'x bf16':>8}{'RSS MB':>9}{'x bf16':>8}{'read MB/rank':>14}{'x bf16':>8}"
        )
        for tp in args.tp:
            runs = {
                "bf16 twin": load_in_child(bf16, args.dtype, "dequantize", tp, args.threads),
                "fp8 dequantized": load_in_child(fp8, args.dtype, "dequantize", tp, args.threads),
                "fp8 kept": load_in_child(fp8, args.dtype, "fp8", tp, args.threads),
            }
            ref = runs["bf16 twin"]
            for label, r in runs.items():
                read, ref_read = max(r["bytes_read"]), max(ref["bytes_read"])
                print(
                    f"{f'tp {tp} {label}':<28}{r['seconds']:>8.2f}{r['seconds'] / ref['seconds']:>8.2f}"
                    f"{r['rss_growth'] / 1e6:>9.0f}{r['rss_growth'] / max(ref['rss_growth'], 1):>8.2f}"
                    f"{read / 1e6:>14.1f}{read / ref_read:>8.2f}"
                )
            out[f"load_tp{tp}"] = runs
            if "held" in ref:
                print(
                    f"tp {tp} bytes held: kept / dequantized "
                    f"{runs['fp8 kept']['held'][0] / runs['fp8 dequantized']['held'][0]:.2f}"
                )
        rates = {
            weights: decode_rate(
                fp8, args.dtype, weights, args.prompt_len, args.new_tokens, args.repeats
            )
            for weights in ("dequantize", "fp8")
        }
        out["decode_tokens_per_s"] = rates
        print(
            f"decode b1 {args.dtype}: dequantized {rates['dequantize']:.1f} tok/s, kept FP8 {rates['fp8']:.1f} "
            f"tok/s, kept / dequantized {rates['fp8'] / rates['dequantize']:.2f}"
        )
    out["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
