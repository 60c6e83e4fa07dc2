"""Generate jobs that can share one forward: which ones, and how their answers are split back.

Greedy jobs (temperature 0) with the same model, runtime, budget, chat template, system
message and modifiers are run as one `ster generate --prompts` over all their prompts, and
each job gets exactly what it would have got alone: the same result mapping for a --prompt
job, its own output file (written by rename) for a --prompts job. Sampled jobs are never
batched: rows of a batch draw from one seeded generator, so a job's tokens would depend on
which other jobs shared its batch.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

from ster_dist.commands.common import write_json_atomic

_PER_JOB = {"prompt", "prompts", "output", "run", "exit_code"}


def batch_key(kind: str, ns) -> tuple | None:
    """What must be equal for jobs to share a forward, or None when this job runs alone."""
    if kind != "generate" or ns.temperature > 0:
        return None
    return tuple(sorted((name, repr(value)) for name, value in vars(ns).items() if name not in _PER_JOB))


def job_prompts(ns) -> list[str]:
    if ns.prompt is not None:
        return [ns.prompt]
    from ster_dist.commands.core import _read_prompts

    return _read_prompts(ns.prompts)


def run_batch(namespaces: list, prompts: list[list[str]]) -> list[dict]:
    """One generate over every job's prompts; the per-job results, in order."""
    with tempfile.TemporaryDirectory(prefix="ster-batch-") as tmp:
        together = copy.copy(namespaces[0])
        together.prompt = None
        together.prompts = str(Path(tmp) / "prompts.json")
        together.output = str(Path(tmp) / "answers.json")
        Path(together.prompts).write_text(json.dumps({"prompts": [p for job in prompts for p in job]}))
        together.run(together)
        answers = json.loads(Path(together.output).read_text())
    rows = answers.pop("results")
    header = answers
    out, start = [], 0
    for ns, job in zip(namespaces, prompts):
        mine = rows[start:start + len(job)]
        start += len(job)
        if ns.prompt is not None:
            out.append({**header, **mine[0]})
        else:
            write_json_atomic(Path(ns.output), {**header, "results": mine})
            out.append({**header, "output": ns.output, "prompts": len(mine)})
    return out
