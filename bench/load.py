"""Load time and peak memory of ster_dist's streaming loader against Transformers' from_pretrained.

One random Llama checkpoint (about 400 MB in f32 by default) is written once; each
measurement then runs in a fresh Python process so that loads do not share pages:

  transformers   AutoModelForCausalLM.from_pretrained(dir, dtype=float32), then every weight
                 read once (it maps the file lazily; reading makes the two loads comparable)
  ster tp=1      resolve + load_model in one process
  ster tp=2      two ranks (torch.multiprocessing, gloo), each loading its shard

For every run it prints the load seconds and the growth of peak RSS (VmHWM, reset just before the
load) over the process's RSS after imports, as ratios ster_dist / Transformers (lower is better),
and for ster_dist the bytes each rank read from the weight files over the checkpoint size.

    python bench/load.py [--hidden 1024 --layers 12 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
from ster_dist.workers.rank import peak_rss_bytes, reset_peak_rss
torch.set_num_threads(int(sys.argv[3]))
kind, path = sys.argv[1], sys.argv[2]
if kind == "transformers":
    import transformers
    base = reset_peak_rss(); start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # Transformers leaves weights as lazy views of the mapped file: touch them so the load is comparable
    total = sum(float(p.sum()) for p in model.parameters())
    out = {"seconds": time.perf_counter() - start, "rss_growth": peak_rss_bytes() - base}
elif kind == "ster1":
    from ster_dist.load import load_model
    from ster_dist.resolve import resolve
    base = reset_peak_rss(); start = time.perf_counter()
    loaded = load_model(resolve(path), "f32")
    out = {"seconds": time.perf_counter() - start, "rss_growth": peak_rss_bytes() - base,
           "bytes_read": [loaded.bytes_read]}
else:
    from ster_dist.resolve import resolve
    from ster_dist.workers.spawn import SpawnGroup
    checkpoint = resolve(path)
    with SpawnGroup(2, threads=max(1, int(sys.argv[3]) // 2)) as group:
        stats = group.call("load", checkpoint, "f32", "cpu")
    out = {"seconds": max(s["load_seconds"] for s in stats),
           "rss_growth": max(s["peak_rss_after"] - s["peak_rss_before"] for s in stats),
           "bytes_read": [s["bytes_read"] for s in stats]}
print(json.dumps(out))
"""


def write_checkpoint(directory: Path, hidden: int, layers: int) -> int:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(directory)
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def run(kind: str, path: Path, threads: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(path), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        size = write_checkpoint(path, args.hidden, args.layers)
        results = {
            kind: run(kind, path, args.threads) for kind in ("transformers", "ster1", "ster2")
        }
    ref = results["transformers"]
    print(f"checkpoint: {size / 1e6:.0f} MB")
    print(f"{'run':<14}{'load s':>9}{'x ref':>8}{'RSS MB':>10}{'x ref':>8}{'read / ckpt':>14}")
    for kind, label in (
        ("transformers", "transformers"),
        ("ster1", "ster tp=1"),
        ("ster2", "ster tp=2 rank"),
    ):
        r = results[kind]
        read = (
            "-" if "bytes_read" not in r else "/".join(f"{b / size:.2f}" for b in r["bytes_read"])
        )
        print(
            f"{label:<14}{r['seconds']:>9.2f}{r['seconds'] / ref['seconds']:>8.2f}"
            f"{r['rss_growth'] / 1e6:>10.0f}{r['rss_growth'] / ref['rss_growth']:>8.2f}{read:>14}"
        )
    summary = {
        "checkpoint_bytes": size,
        **{k: v for k, v in results.items()},
        "load_seconds_ratio_tp1": results["ster1"]["seconds"] / ref["seconds"],
        "load_seconds_ratio_tp2": results["ster2"]["seconds"] / ref["seconds"],
        "peak_rss_ratio_tp1": results["ster1"]["rss_growth"] / ref["rss_growth"],
        "peak_rss_ratio_tp2_rank": results["ster2"]["rss_growth"] / ref["rss_growth"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
