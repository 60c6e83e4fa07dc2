"""Pipeline parallelism against tensor parallelism on two CPU ranks: the token engine's throughput
at PP2 and TP2, batch 1 and batch 8, the bubble each stage sees, and the bytes each exchanges.

What is built
    A random Llama checkpoint (bench/common.py; default hidden 512, 8 layers, f32), loaded on two
    spawned gloo ranks three ways: --tp 2; --pp 2 with one step in flight (micro_batches 1: the
    stages take turns); --pp 2 with two in flight (micro_batches 2: vLLM's virtual engines, the
    stages working at once on different requests).

What is measured (same prompts, greedy, --new-tokens per request, best of --repeats)
    tokens/s  generated tokens over the wall time of the token engine serving `batch` requests
              submitted at once (batch 1 and --batch), after one untimed warm-up round.
    bubble    per rank, the share of the engine's wall time it spent neither computing a step nor
              sending: 1 - (step seconds - seconds waiting for the previous stage) / wall seconds
              (ModelRunner.timings; the first stage waits on the driver, the second on the first).
    bytes     per token per stage boundary, PP sends one hidden state (hidden x dtype bytes); TP
              all-reduces twice per layer (attention and feed-forward output), each a ring moving
              2 (n - 1) / n of the hidden state per rank: computed from the config, printed side by
              side.

Ratios are PP / TP (throughput: higher is better). On two CPU cores shared by both ranks the
stages cannot truly run in parallel with all their threads; the figures show the mechanics
(overlap, bubble, traffic), not a GPU's speedup.

    python bench/pipeline.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LlamaShape, ensure_checkpoint  # noqa: E402

import torch  # noqa: E402

from ster_dist.config.load import model_config  # noqa: E402
from ster_dist.engine.loop import EngineConfig, TokenEngine  # noqa: E402
from ster_dist.engine.client import RunnerClient  # noqa: E402
from ster_dist.engine.sampling import SamplingParams  # noqa: E402
from ster_dist.resolve import resolve  # noqa: E402
from ster_dist.tokenizer import Tokenizer  # noqa: E402
from ster_dist.workers.spawn import SpawnGroup  # noqa: E402


def serve(
    group, checkpoint, cfg, prompts, new_tokens: int, micro_batches: int, repeats: int
) -> dict:
    """Best tokens/s of the engine serving every prompt at once, with the ranks' timings of that
    round."""
    config = EngineConfig(
        kv_cache_memory=64 << 20, block_size=16, max_step_tokens=256, micro_batches=micro_batches
    )
    best = None
    with TokenEngine(
        group, cfg, Tokenizer.from_directory(checkpoint.directory), (), config
    ) as engine:
        for round_ in range(repeats + 1):  # the first round is the warm-up
            before = RunnerClient(group).timings()
            start = time.perf_counter()
            streams = [
                engine.submit(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
                for p in prompts
            ]
            tokens = sum(len(s.result().token_ids) for s in streams)
            wall = time.perf_counter() - start
            after = RunnerClient(group).timings()
            if round_ == 0:
                continue
            rate = tokens / wall
            if best is None or rate > best["tokens_per_s"]:
                bubbles = [
                    max(0.0, 1 - ((a["step_s"] - b["step_s"]) - (a["wait_s"] - b["wait_s"])) / wall)
                    for a, b in zip(after, before)
                ]
                best = {"tokens_per_s": rate, "wall_s": wall, "bubble_per_rank": bubbles}
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument(
        "--quick", action="store_true", help="hidden 256, 4 layers, 16 new tokens, 1 repeat"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.new_tokens, args.repeats = 256, 4, 16, 1
    shape = LlamaShape.scaled(args.hidden, args.layers, vocab=8000)
    directory = args.model_dir or Path(tempfile.mkdtemp(prefix="ster_bench_pp_"))
    ensure_checkpoint(directory, shape, torch.float32)
    checkpoint = resolve(str(directory))
    cfg = model_config(checkpoint)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, shape.vocab, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.batch)
    ]
    layouts = {"tp2": dict(world=2), "pp2_mb1": dict(world=2, pp=2), "pp2_mb2": dict(world=2, pp=2)}
    results: dict = {}
    for name, layout in layouts.items():
        with SpawnGroup(layout["world"], threads=args.threads, pp=layout.get("pp", 1)) as group:
            group.call("load", checkpoint, "f32", "cpu")
            micro = 2 if name == "pp2_mb2" else 1
            results[name] = {
                f"batch{n}": serve(
                    group, checkpoint, cfg, prompts[:n], args.new_tokens, micro, args.repeats
                )
                for n in (1, args.batch)
            }
    itemsize = 4
    per_boundary = cfg.hidden_size * itemsize
    all_reduce = 2 * cfg.num_layers * cfg.hidden_size * itemsize * 2 * (2 - 1) / 2
    out = {
        "shape": {"hidden": cfg.hidden_size, "layers": cfg.num_layers},
        "threads_per_rank": args.threads,
        "load_average": os.getloadavg()[0],
        "results": results,
        "bytes_per_token": {
            "pp_per_stage_boundary": per_boundary,
            "tp_all_reduce_per_rank": all_reduce,
            "ratio_pp_over_tp": per_boundary / all_reduce,
        },
    }
    for n in (1, args.batch):
        tp = results["tp2"][f"batch{n}"]["tokens_per_s"]
        out[f"pp2_over_tp2_batch{n}"] = {
            k: results[k][f"batch{n}"]["tokens_per_s"] / tp for k in ("pp2_mb1", "pp2_mb2")
        }
    print(f"{'layout':10} {'batch':>5} {'tok/s':>9} {'bubble per rank':>20}")
    for name, by_batch in results.items():
        for key, r in by_batch.items():
            bubbles = " ".join(f"{b:.2f}" for b in r["bubble_per_rank"])
            print(f"{name:10} {key[5:]:>5} {r['tokens_per_s']:9.1f} {bubbles:>20}")
    print(
        f"bytes/token: PP boundary {per_boundary} vs TP all-reduce {all_reduce:.0f} per rank "
        f"({per_boundary / all_reduce:.3f}x)"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
