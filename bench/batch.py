"""Batch inference three ways against one `ster generate --prompts` call, on the same prompts.

What is built
    A toy Llama (`ster toy-model`: --layers, --hidden) unless --model names a directory.

What is measured (greedy, --new-tokens per prompt, --prompts prompts, output tokens/s each)
    one_call    one `ster generate --prompts` over all prompts through a loaded Session: the floor.
    jobs        the prompts split into --jobs prompts files, submitted at once to one JobQueue
                (each job in its lane, all on the group's one token engine); the group is loaded
                by a warm-up job first, so both paths start warm.
    batch_N     `ster batch --replicas N` for each N of --replicas, as a command in a process of
                its own (its embedded Ray cluster and replica loads included, as a user runs it);
                the command's peak RSS (the driver: replicas are Ray actors) is reported beside.
The answers of one_call and jobs are checked equal.

    python bench/batch.py --prompts 2000 --jobs 20 --replicas 1 2      # the issue's figures
    python bench/batch.py --prompts 64 --jobs 6 --replicas 2           # a short run on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ster_dist import ops  # noqa: E402
from ster_dist.jobqueue.queue import JobQueue  # noqa: E402
from ster_dist.schema import GenerateRequest  # noqa: E402
from ster_dist.session import Session  # noqa: E402


def _answers(path: Path) -> list[str]:
    return [a["text"] for a in json.loads(path.read_text())["results"]]


def one_call(model: str, prompts: Path, out: Path, new_tokens: int) -> tuple[float, list[str]]:
    request = GenerateRequest(
        model=model, prompts=str(prompts), output=str(out), max_new_tokens=new_tokens
    )
    with contextlib.redirect_stderr(io.StringIO()), Session(request) as session:
        ops.generate(session, GenerateRequest(model=model, prompt="warm", max_new_tokens=2))
        started = time.perf_counter()
        ops.generate(session, request)
        return time.perf_counter() - started, _answers(out)


def through_jobs(
    model: str, files: list[Path], tmp: Path, new_tokens: int
) -> tuple[float, list[str]]:
    specs = [
        {
            "kind": "generate",
            "model": model,
            "prompts": str(f),
            "output": str(tmp / f"job-{i}.json"),
            "max_new_tokens": new_tokens,
        }
        for i, f in enumerate(files)
    ]
    with contextlib.redirect_stderr(io.StringIO()), JobQueue(tmp / "state") as queue:
        queue.wait(
            queue.submit(
                {"kind": "generate", "model": model, "prompt": "warm", "max_new_tokens": 2}
            ),
            600,
        )
        started = time.perf_counter()
        ids = queue.submit_many(specs)
        records = [queue.wait(i, 3600) for i in ids]
        seconds = time.perf_counter() - started
    assert all(r["status"] == "done" for r in records), [
        r["error"] for r in records if r["status"] != "done"
    ]
    return seconds, [text for i in range(len(files)) for text in _answers(tmp / f"job-{i}.json")]


def ster_batch(model: str, rows: Path, out: Path, replicas: int, new_tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ster_dist.cli",
            "batch",
            "--model",
            model,
            "--input",
            str(rows),
            "--output",
            str(out),
            "--replicas",
            str(replicas),
            "--max-new-tokens",
            str(new_tokens),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"ster batch failed: {done.stderr[-2000:]}")
    tokens = sum(
        json.loads(line)["completion_tokens"]
        for p in out.glob("*.jsonl")
        for line in p.read_text().splitlines()
    )
    # the largest child so far
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "seconds": round(seconds, 2),
        "tokens": tokens,
        "driver_peak_rss_mb_at_most": round(peak_mb),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--jobs", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--replicas", type=int, nargs="*", default=[1, 2])
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ster-bench-batch-") as name:
        tmp = Path(name)
        model = args.model
        if model is None:
            from ster_dist.load.toy import make_toy_model

            model = str(tmp / "toy")
            make_toy_model(Path(model), layers=args.layers, hidden=args.hidden, seed=0)
        prompts = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(args.prompts)]
        every = tmp / "prompts.json"
        every.write_text(json.dumps({"prompts": prompts}))
        share = -(-len(prompts) // args.jobs)
        files = []
        for j in range(args.jobs):
            files.append(tmp / f"prompts-{j}.json")
            files[-1].write_text(json.dumps({"prompts": prompts[j * share : (j + 1) * share]}))
        one_s, one = one_call(model, every, tmp / "one.json", args.new_tokens)
        jobs_s, jobs = through_jobs(model, files, tmp, args.new_tokens)
        assert jobs == one, "the jobs' answers differ from the one call's"
        rows = tmp / "rows.jsonl"
        rows.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        batches = {
            n: ster_batch(model, rows, tmp / f"batch-{n}", n, args.new_tokens)
            for n in args.replicas
        }
    report = {
        "prompts": args.prompts,
        "jobs": args.jobs,
        "new_tokens": args.new_tokens,
        "one_call_s": round(one_s, 3),
        "jobs_s": round(jobs_s, 3),
        "ratio_jobs_to_one_call": round(one_s / jobs_s, 3),
        **{f"batch_{n}": b for n, b in batches.items()},
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
