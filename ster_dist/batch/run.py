"""`ster batch`: a dataset of prompts answered by N replicas of a model over Ray Data.

The input (a JSONL or Parquet file, or a directory of them) is read with `ray.data`; rows whose
key is already in the output directory (a rerun) are skipped; the rest go through
`map_batches(Replica, concurrency=N)`, an actor pool of N replicas each holding the model once,
and are written to the output directory as Parquet (or JSONL) files named for this run, so a rerun
adds files beside those of earlier runs. Input order is kept (Ray Data's preserve_order) within
each run. The driver holds only the keys already written, never the rows.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

from ster_dist.batch.processor import processor
from ster_dist.errors import Refusal
from ster_dist.events import progress

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def input_files(path: str) -> tuple[list[str], str]:
    """The input's files and their format (one format per input), refused before Ray starts."""
    root = Path(path)
    if root.is_dir():
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file() and p.suffix in FORMATS and not p.name.startswith(".")
        )
    elif root.is_file():
        files = [root]
    else:
        raise Refusal(
            f"--input {path} does not exist; give a JSONL or Parquet file, or a directory of them"
        )
    kinds = {FORMATS.get(p.suffix) for p in files}
    if not files or None in kinds:
        raise Refusal(
            f"--input {path}: give .jsonl or .parquet files (found "
            f"{', '.join(sorted({p.suffix or p.name for p in files})) or 'none'})"
        )
    if len(kinds) > 1:
        raise Refusal(f"--input {path} mixes JSONL and Parquet files; give one kind")
    return [str(p.resolve()) for p in files], kinds.pop()


def written_keys(output: Path, fmt: str) -> set[str]:
    """The row keys an earlier run wrote to the output directory (its files only, in its format)."""
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    keys: set[str] = set()
    for path in sorted(output.glob(f"*.{'parquet' if fmt == 'parquet' else 'jsonl'}")):
        try:
            table = (
                pq.read_table(path, columns=["row_key"])
                if fmt == "parquet"
                else pajson.read_json(path)
            )
        except Exception as exc:  # a file a killed run left half-written
            raise Refusal(
                f"output file {path} is unreadable ({type(exc).__name__}); remove it and run again"
            ) from None
        if "row_key" in table.column_names:
            keys.update(table.column("row_key").to_pylist())
    return keys


def run_batch(request) -> dict:
    import ray
    import ray.data

    from ster_dist.batch.rows import row_key
    from ster_dist.workers.ray_group import start_ray

    files, kind = input_files(request.input)
    output = Path(request.output)
    if output.exists() and not output.is_dir():
        raise Refusal(f"--output {output} is a file; give a directory")
    fmt = request.format or ("parquet" if kind == "parquet" else "jsonl")
    done = written_keys(output, fmt) if output.is_dir() else set()
    started = time.perf_counter()
    start_ray(request.address)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    ds = (
        ray.data.read_parquet(files) if kind == "parquet" else ray.data.read_json(files, lines=True)
    )
    if done:
        ds = ds.filter(lambda row: row_key(row) not in done)
    answered = ds.map_batches(processor(request), **_pool_options(request))
    output.mkdir(parents=True, exist_ok=True)
    run_id = f"run-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    write = answered.write_parquet if fmt == "parquet" else answered.write_json
    try:
        write(
            str(output),
            filename_provider=_names(run_id, "parquet" if fmt == "parquet" else "jsonl"),
            **({} if fmt == "parquet" else {"lines": True}),
        )
    # a row a replica refused comes back wrapped in Ray's exceptions: its line alone
    except Exception as exc:
        refused = re.search(r"ster_dist\.errors\.\w+: (.+)", str(exc))
        if refused is None:
            raise
        raise Refusal(
            f"{refused.group(1).strip()} (rows answered before it stay in {output}; a rerun skips them)"
        ) from None
    total = len(written_keys(output, fmt))
    seconds = time.perf_counter() - started
    progress(
        f"answered {total - len(done)} row(s) in {seconds:.1f} s ({len(done)} already written)"
    )
    return {
        "output": str(output),
        "format": fmt,
        "rows_written": total - len(done),
        "rows_skipped": len(done),
        "rows_total": total,
        "replicas": request.replicas,
        "seconds": round(seconds, 3),
        "run": run_id,
    }


def _pool_options(request) -> dict:
    """map_batches' options: an actor pool of `replicas`, each reserving its ranks' CPUs (or
    GPUs)."""
    ranks = request.tp * request.ep * request.pp
    options = {
        "concurrency": request.replicas,
        "batch_size": request.batch_size,
        "batch_format": "pandas",
    }
    if request.device == "cuda":
        options["num_gpus"] = ranks
    else:
        # a CPU each (the ranks of a tp > 1 replica are Ray actors of their own), less where that
        # would leave
        # the read and write tasks none: they would wait for ever behind the replicas
        import ray

        cpus = ray.cluster_resources().get("CPU", 1.0)
        options["num_cpus"] = max(0.01, min(1.0, (cpus - 1) / request.replicas))
    return options


def _names(run_id: str, extension: str):
    from ray.data.datasource import FilenameProvider

    class RunFiles(FilenameProvider):
        """Files named for this run and the block's place: a rerun never overwrites an earlier
        run's."""

        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"{run_id}-{task_index:06d}.{extension}"

        def get_filename_for_block(
            self, block, write_uuid: str, task_index: int, block_index: int
        ) -> str:
            return f"{run_id}-{task_index:06d}-{block_index:06d}.{extension}"

    return RunFiles()
