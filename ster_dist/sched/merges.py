"""Batch merge jobs: `{"kind": "merge", "merges": [{"model", "adapter", "output", "revision"?}, ...],
"max_shard_size"?}` runs jobs/merge.py's batch_merge (every shard of every merge one Ray task)
instead of one `ster merge`. A spec naming single-merge flags (model, adapter, output) runs
`ster merge` itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ster_dist.commands.common import progress
from ster_dist.errors import Refusal

JOBS_MERGE = Path(__file__).resolve().parent.parent.parent / "jobs" / "merge.py"
ITEM_FIELDS = {"model": True, "adapter": True, "output": True, "revision": False}
BATCH_FIELDS = ("merges", "max_shard_size")


def check_batch(fields: dict) -> None:
    """The batch's shape, field by field, before anything runs."""
    if not JOBS_MERGE.is_file():
        raise Refusal(f"batch merge jobs need {JOBS_MERGE} beside the package; give one merge's model, adapter "
                      "and output instead")
    merges = fields.get("merges")
    if not isinstance(merges, list) or not merges:
        raise Refusal("job spec field 'merges' must list at least one {model, adapter, output} mapping")
    outputs = set()
    for index, item in enumerate(merges):
        where = f"job spec field 'merges' item {index}"
        if not isinstance(item, dict):
            raise Refusal(f"{where} must be a mapping of model, adapter, output (and revision)")
        for name in item:
            if name not in ITEM_FIELDS:
                raise Refusal(f"{where} has the unknown field {name!r}; known: {', '.join(ITEM_FIELDS)}")
        for name, required in ITEM_FIELDS.items():
            value = item.get(name)
            if value is None and not required:
                continue
            if not isinstance(value, str) or not value.strip():
                raise Refusal(f"{where} field {name!r} must be a non-empty string, got {value!r}")
        output = str(Path(item["output"]).resolve())
        if output in outputs:
            raise Refusal(f"{where} writes {item['output']} again; give each merge its own output")
        outputs.add(output)
    size = fields.get("max_shard_size")
    if size is not None and not isinstance(size, str):
        raise Refusal(f"job spec field 'max_shard_size' must be a string such as 5GB, got {size!r}")


def run_batch_merge(ns) -> dict:
    spec = importlib.util.spec_from_file_location("ster_jobs_merge", JOBS_MERGE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    batch = {"merges": ns.merges}
    if ns.max_shard_size is not None:
        batch["max_shard_size"] = ns.max_shard_size
    result = module.batch_merge(batch, progress)
    ns.exit_code = 1 if result.get("failed") else 0
    return result
