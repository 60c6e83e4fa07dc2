"""Batch LoRA merges fanned out over a Ray cluster, shard by shard.

    ray job submit -- python jobs/merge.py SPEC.json [--address ADDR]
    python jobs/merge.py SPEC.json              # a local Ray cluster of this machine's cores

SPEC is {"merges": [{"model": M, "adapter": A, "output": DIR, "revision": R?}, ...],
"max_shard_size": "5GB"?, "address": ADDR?}. Each distinct (model, revision) is resolved once;
each merge is planned from headers (every refusal happens here, before any weight is read) and
split into its output shards, and every shard of every merge is one Ray task, so the workers
write in parallel across merges. A shard is renamed into the merge's work directory only when
complete, so a killed job rerun with the same SPEC writes only the shards still missing; an
output that already exists counts as done. Progress goes to stderr as JSON lines, the report to
stdout. The output directories must be on storage every node writes to.

The job queue calls batch_merge(spec, progress) directly (ster_dist/ops/merge.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ster_dist.errors import Refusal


def _check_spec(spec) -> list[dict]:
    merges = spec.get("merges") if isinstance(spec, dict) else None
    if not isinstance(merges, list) or not merges:
        raise Refusal(
            'a merge job spec must be {"merges": [{"model": M, "adapter": A, "output": DIR}, ...]} '
            "with at least one merge"
        )
    for index, item in enumerate(merges):
        missing = [
            k
            for k in ("model", "adapter", "output")
            if not isinstance(item, dict) or not item.get(k)
        ]
        if missing:
            raise Refusal(
                f"merge {index} of the job spec lacks {', '.join(missing)}; give model, adapter and output"
            )
    outputs = [str(Path(m["output"]).resolve()) for m in merges]
    twice = [o for i, o in enumerate(outputs) if o in outputs[:i]]
    if twice:
        raise Refusal(
            f"two merges of the job spec write {twice[0]}; give each merge its own output"
        )
    return merges


def batch_merge(spec: dict, progress=None) -> dict:
    """Run every merge of `spec` over Ray; returns one result per merge and the totals."""
    import ray

    from ster_dist.adapters.merge import DEFAULT_MAX_SHARD, finish, prepare
    from ster_dist.resolve import resolve
    from ster_dist.shard.writer import write_shard
    from ster_dist.workers.ray_group import start_ray

    progress = progress or (lambda message, **fields: None)
    start = time.perf_counter()
    merges = _check_spec(spec)
    max_shard = spec.get("max_shard_size", DEFAULT_MAX_SHARD)
    results: list[dict] = [
        {"model": m["model"], "adapter": m["adapter"], "output": m["output"]} for m in merges
    ]
    bases: dict[tuple, object] = {}
    plans: dict[int, object] = {}
    for index, item in enumerate(merges):
        key = (item["model"], item.get("revision"))
        try:
            if Path(item["output"]).exists():
                results[index]["status"] = "exists"
                continue
            if key not in bases:
                progress(f"resolving {item['model']}")
                bases[key] = resolve(*key)
            plans[index] = prepare(
                item["model"],
                item["adapter"],
                item["output"],
                item.get("revision"),
                max_shard,
                checkpoint=bases[key],
            )
        except Refusal as refusal:
            results[index].update(status="failed", refusal=str(refusal))
    total = sum(len(plan.names) for plan in plans.values())
    todo = sum(len(plan.pending) for plan in plans.values())
    progress(
        f"{len(plans)} merges planned over {len(bases)} bases: {todo} of {total} shards to write",
        merges=len(plans),
        shards=total,
        pending=todo,
    )
    started = start_ray(spec.get("address"))
    written = 0
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(write_shard)
        running = {}
        for index, plan in plans.items():
            for shard in plan.pending:
                ref = task.remote(plan.shard_path(shard), plan.shards[shard])
                running[ref] = (index, shard)
        left = {index: len(plan.pending) for index, plan in plans.items()}
        done = 0
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            index, shard = running.pop(ready[0])
            plan = plans[index]
            try:
                written += ray.get(ready[0])
            # a worker's refusal or crash fails this merge only
            except (ray.exceptions.RayError, Refusal) as exc:
                cause = getattr(exc, "cause", None) or exc
                results[index].update(
                    status="failed",
                    refusal=f"shard {plan.names[shard]}: {str(cause).strip()[:300]}",
                )
            done += 1
            left[index] -= 1
            progress(
                f"wrote {plan.names[shard]} of {plan.output}",
                shard=done,
                shards=todo,
                bytes=written,
            )
        for index, plan in plans.items():
            if results[index].get("status") == "failed":
                continue
            try:
                results[index].update(status="merged", report=finish(plan))
            except Refusal as refusal:
                results[index].update(status="failed", refusal=str(refusal))
    finally:
        if started:
            ray.shutdown()
    counts = {s: sum(r.get("status") == s for r in results) for s in ("merged", "exists", "failed")}
    return {
        "merges": results,
        **counts,
        "bases": len(bases),
        "shards": total,
        "shards_written": todo,
        "shards_resumed": total - todo,
        "bytes_written": written,
        "seconds": round(time.perf_counter() - start, 3),
    }


def main(argv: list[str] | None = None) -> int:
    from ster_dist.events import progress
    from ster_dist.inputs import read_json

    parser = argparse.ArgumentParser(description="Batch LoRA merges over a Ray cluster.")
    parser.add_argument(
        "spec", help='a JSON file: {"merges": [{"model", "adapter", "output"}, ...]}'
    )
    parser.add_argument(
        "--address", default=None, help="the Ray cluster (else the spec's, RAY_ADDRESS, or local)"
    )
    args = parser.parse_args(argv)
    try:
        spec = read_json(args.spec, "merge job spec")
        if args.address:
            spec = {**spec, "address": args.address}
        result = batch_merge(spec, progress)
    except Refusal as refusal:
        print(str(refusal), file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
