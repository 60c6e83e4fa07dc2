"""merge: fold a LoRA adapter into a base checkpoint (streamed tensor by tensor, ster_dist/adapters/
merge.py); a batch of merges runs jobs/merge.py's fan-out, every shard of every merge a Ray task.
A cancelled merge job stops after the shard it is writing: the merge's work directory stays (a
rerun resumes from it), the output is never made."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ster_dist import running
from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.inputs import output_not_an_input
from ster_dist.schema.merge import BatchMergeRequest, MergeRequest

JOBS_MERGE = Path(__file__).resolve().parent.parent.parent / "jobs" / "merge.py"


def merge(request: MergeRequest) -> dict:
    from ster_dist.adapters.merge import merge as merge_adapter

    # a merged checkpoint is never written into the model or the adapter
    output_not_an_input(request)
    job = running.current()
    job.check()
    progress(f"merging {request.adapter} into {request.model}")

    def progress_or_stop(message: str, **fields) -> None:
        progress(message, **fields)
        job.check()  # called after each shard is written: a cancel stops before the next one

    return merge_adapter(
        request.model,
        request.adapter,
        request.output,
        request.revision,
        request.max_shard_size,
        progress_or_stop,
    )


def check_batch_available() -> None:
    if not JOBS_MERGE.is_file():
        raise Refusal(
            f"batch merge jobs need {JOBS_MERGE} beside the package; give one merge's model, adapter "
            "and output instead"
        )


def batch_merge(request: BatchMergeRequest) -> dict:
    check_batch_available()
    spec = importlib.util.spec_from_file_location("ster_jobs_merge", JOBS_MERGE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    batch = {"merges": [item.model_dump(exclude_none=True) for item in request.merges]}
    if request.max_shard_size is not None:
        batch["max_shard_size"] = request.max_shard_size
    return module.batch_merge(batch, progress)
