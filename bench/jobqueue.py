"""The job queue's cost: many short generate jobs through it against one direct batched call.

What is built
    A small random Llama (`ster toy-model`: --layers 4, --hidden 256 by default, a real BPE
    tokenizer and chat template) unless --model names a directory. Everything runs in this process
    on the CPU with the same torch thread count; the model is loaded once before any clock starts (a
    warm-up job loads the job queue's worker group; the direct path holds its own loaded Session).

What is measured (greedy, up to --new-tokens per prompt, the same --jobs prompts in every case)
    direct      one `ster generate --prompts` call over all prompts, through an already loaded
                Session: the floor, every prompt in the token engine's batch (best of --repeats).
    scheduled   the same prompts as --jobs single-prompt jobs submitted at once to a JobQueue
                (journal on disk, fsync per record): validation, journal, queue, each job in a
                lane of its own, all feeding the group's one token engine (best of --repeats).
    unbatched   the same jobs through a JobQueue with max_lanes=1: one job at a time, what the
                queue would cost without its jobs sharing the engine.
    latency     one job at a time, submit -> result, against the same single prompt called
                directly (median of --latency-runs each): the job queue's added latency per job.
    command     `ster generate --prompt` as a whole command line in this process (cli.main: an
                in-process job queue started, the model loaded, the job run, all closed) against
                the generate command's function called directly with the same flags (its own
                load too), median of --command-runs each: what the front door costs a command.
    ratio       jobs/s scheduled over jobs/s direct (1.0 = no overhead).
The answers of every path are checked equal.

    python bench/jobqueue.py                       # about 20-40 s on 2 cores
    python bench/jobqueue.py --jobs 256 --new-tokens 8 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ster_dist import ops  # noqa: E402
from ster_dist.jobqueue.queue import JobQueue  # noqa: E402
from ster_dist.schema import GenerateRequest  # noqa: E402
from ster_dist.session import Session  # noqa: E402


def _quiet(fn):
    with contextlib.redirect_stderr(io.StringIO()):
        return fn()


def _in_thread(fn):
    """Run fn on a fresh thread, as the job queue's executor runs its jobs: with several torch
    threads, a loaded machine slows the main thread's OpenMP team far more than another thread's
    (measured here: one 4-layer forward 286 ms on the main thread, 6 ms on a second one), which
    would credit the job queue with a speed-up that is only a thread difference."""
    box = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["out"]


def _direct(session: Session, model: str, prompts: list[str], new_tokens: int) -> list[str]:
    """The operation itself on a loaded session: one prompts file, every prompt in the engine at
    once."""
    with tempfile.TemporaryDirectory(prefix="ster-bench-direct-") as tmp:
        path, output = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        path.write_text(json.dumps({"prompts": prompts}))
        if len(prompts) == 1:
            request = GenerateRequest(model=model, prompt=prompts[0], max_new_tokens=new_tokens)
            return [ops.generate(session, request).results[0].text]
        request = GenerateRequest(
            model=model, prompts=str(path), output=str(output), max_new_tokens=new_tokens
        )
        ops.generate(session, request)
        return [answer["text"] for answer in json.loads(output.read_text())["results"]]


def _scheduled(scheduler: JobQueue, model: str, prompts: list[str], new_tokens: int) -> list[str]:
    ids = scheduler.submit_many(
        [
            {"kind": "generate", "model": model, "prompt": p, "max_new_tokens": new_tokens}
            for p in prompts
        ]
    )
    return [scheduler.wait(i, 600)["result"]["text"] for i in ids]


def _command_runs(
    model: str, new_tokens: int, runs: int
) -> tuple[list[float], list[float], str, str]:
    """Seconds per whole `ster generate` through cli.main and through the operation on a fresh
    session."""
    from ster_dist.cli import main as cli_main
    from ster_dist.cli import parse

    argv = [
        "generate",
        "--model",
        model,
        "--prompt",
        "Question 0",
        "--max-new-tokens",
        str(new_tokens),
    ]
    through, plain, texts = [], [], {}
    for _ in range(runs):
        out = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(out):
            assert _quiet(lambda: cli_main(argv)) == 0  # noqa: B023 (called at once)
        through.append(time.perf_counter() - start)
        texts["cli"] = json.loads(out.getvalue())["text"]
        start = time.perf_counter()
        request = parse(argv)

        def plain_run():
            with Session(request) as session:
                return ops.generate(session, request).results[0].text  # noqa: B023 (called at once)

        texts["plain"] = _in_thread(lambda: _quiet(plain_run))
        plain.append(time.perf_counter() - start)
    return through, plain, texts["cli"], texts["plain"]


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="a model directory (default: a toy Llama built here)"
    )
    p.add_argument("--layers", type=int, default=4, help="the toy model's layers")
    p.add_argument("--hidden", type=int, default=256, help="the toy model's width")
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-runs", type=int, default=20)
    p.add_argument("--command-runs", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="ster-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = args.model
        if model is None:
            from ster_dist.load.toy import make_toy_model

            model = str(tmp / "toy")
            make_toy_model(Path(model), layers=args.layers, hidden=args.hidden, seed=0)
        prompts = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(args.jobs)]

        # direct: one batched call through a loaded Session, on a thread of its own like the
        # executor
        def direct_runs():
            held = Session(GenerateRequest(model=model, prompt="x"))
            try:
                # warm: loads the model
                _quiet(lambda: _direct(held, model, prompts[:2], args.new_tokens))
                best = _best(
                    lambda: _quiet(lambda: _direct(held, model, prompts, args.new_tokens)),
                    args.repeats,
                )
                times = []
                for i in range(args.latency_runs):
                    prompt = prompts[i % len(prompts)]
                    start = time.perf_counter()
                    _quiet(lambda: _direct(held, model, [prompt], args.new_tokens))  # noqa: B023 (called at once)
                    times.append(time.perf_counter() - start)
                return best, times
            finally:
                held.close()

        (direct_s, direct), single = _in_thread(direct_runs)

        with JobQueue(tmp / "state") as scheduler:
            # loads the group
            _quiet(lambda: _scheduled(scheduler, model, prompts[:1], args.new_tokens))
            scheduled_s, scheduled = _best(
                lambda: _quiet(lambda: _scheduled(scheduler, model, prompts, args.new_tokens)),
                args.repeats,
            )
            latency = []
            for i in range(args.latency_runs):
                prompt = prompts[i % len(prompts)]
                start = time.perf_counter()
                _quiet(lambda: _scheduled(scheduler, model, [prompt], args.new_tokens))  # noqa: B023 (called at once)
                latency.append(time.perf_counter() - start)
            lanes_peak = scheduler.stats()["lanes_peak"]
        with JobQueue(tmp / "state-unbatched", max_lanes=1) as scheduler:
            _quiet(lambda: _scheduled(scheduler, model, prompts[:1], args.new_tokens))
            unbatched_s, unbatched = _best(
                lambda: _quiet(lambda: _scheduled(scheduler, model, prompts, args.new_tokens)), 1
            )
        through, plain, cli_text, plain_text = _command_runs(
            model, args.new_tokens, args.command_runs
        )
    assert scheduled == direct == unbatched, "the job queue's answers differ from the direct call's"
    assert cli_text == plain_text, "the command line's answer differs from the command function's"
    report = {
        "jobs": args.jobs,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "direct_s": round(direct_s, 4),
        "scheduled_s": round(scheduled_s, 4),
        "unbatched_s": round(unbatched_s, 4),
        "direct_jobs_per_s": round(args.jobs / direct_s, 1),
        "scheduled_jobs_per_s": round(args.jobs / scheduled_s, 1),
        "unbatched_jobs_per_s": round(args.jobs / unbatched_s, 1),
        "ratio_scheduled_to_direct": round(direct_s / scheduled_s, 3),
        "ratio_unbatched_to_direct": round(direct_s / unbatched_s, 3),
        "single_direct_ms": round(1000 * statistics.median(single), 2),
        "single_scheduled_ms": round(1000 * statistics.median(latency), 2),
        "added_latency_ms": round(
            1000 * (statistics.median(latency) - statistics.median(single)), 2
        ),
        "lanes_peak": lanes_peak,
        "command_cli_ms": round(1000 * statistics.median(through), 1),
        "command_function_ms": round(1000 * statistics.median(plain), 1),
        "ratio_command_function_to_cli": round(
            statistics.median(plain) / statistics.median(through), 3
        ),
    }
    print(f"{'path':<12}{'seconds':>10}{'jobs/s':>10}{'vs direct':>11}")
    for name in ("direct", "scheduled", "unbatched"):
        seconds = report[f"{name}_s"]
        print(f"{name:<12}{seconds:>10.3f}{args.jobs / seconds:>10.1f}{direct_s / seconds:>11.3f}")
    print(
        f"one job at a time: direct {report['single_direct_ms']} ms, scheduled {report['single_scheduled_ms']} ms, "
        f"added {report['added_latency_ms']} ms per job"
    )
    print(
        f"a whole command: through the job queue {report['command_cli_ms']} ms, the command function "
        f"{report['command_function_ms']} ms (ratio {report['ratio_command_function_to_cli']})"
    )
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
