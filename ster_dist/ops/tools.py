"""Commands that run no job: the family table, a model's description, a tiny checkpoint, a GGUF
import. An import or toy model into a directory that already holds the same one is a no-op that
says so (the README's main job can be run again); `force` replaces a directory holding another."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ster_dist.atomic import partial_prefix, refusing_full_disk, sweep_stale, write_json
from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.schema.tools import (
    FamiliesRequest,
    GgufImportRequest,
    InspectModelRequest,
    ToyModelRequest,
)

MARKER = ".ster-made.json"  # what made a directory: compared by a rerun


def families(request: FamiliesRequest) -> dict:
    from ster_dist.families.registry import family_table

    table = family_table()
    counts: dict[str, int] = {}
    for row in table:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    progress(
        f"listed {len(table)} families from the registry: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    )
    return {"families": table, "counts": counts}


def inspect_model(request: InspectModelRequest) -> dict:
    from ster_dist.config.load import model_config
    from ster_dist.resolve import describe, resolve

    progress(f"resolving {request.model}: its config and file names, no weights")
    checkpoint = resolve(request.model, request.revision)
    out = describe(checkpoint)
    try:
        out["config"] = model_config(checkpoint).summary()
    except Refusal as refusal:  # resolvable but not (yet) runnable: say so, still describe it
        out["config"] = None
        out["runnable"] = str(refusal)
    return out


def toy_model(request: ToyModelRequest) -> dict:
    from ster_dist.load.toy import make_toy_model

    made = {"maker": "toy-model", **request.model_dump(exclude={"directory", "force"})}
    progress(
        f"writing a toy {request.family} model of {request.layers} layer(s), hidden size {request.hidden}, "
        f"into {request.directory}"
    )
    return _made_once(
        Path(request.directory),
        made,
        request.force,
        lambda out: make_toy_model(
            out,
            family=request.family,
            layers=request.layers,
            hidden=request.hidden,
            experts=request.experts,
            seed=request.seed,
        ),
    )


def gguf_import(request: GgufImportRequest) -> dict:
    from ster_dist.gguf.importer import import_gguf

    source = Path(request.file)
    try:
        stat = source.stat()
    except OSError as exc:
        raise Refusal(f"{request.label('file')} {source}: {exc.strerror or exc}") from None
    made = {
        "maker": "gguf-import",
        "source": str(source.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "safetensors": request.safetensors,
    }
    directory = Path(request.directory)
    progress(
        f"importing {source} ({stat.st_size / 2**20:.1f} MiB) into {directory}"
        + (" as safetensors" if request.safetensors else ", the .gguf placed beside its config")
    )
    with refusing_full_disk(directory):
        return _made_once(
            directory,
            made,
            request.force,
            lambda out: import_gguf(source, out, to_safetensors=request.safetensors),
        )


def _made_once(directory: Path, made: dict, force: bool, make) -> dict:
    """make(directory), unless it already holds what `made` describes (then a no-op, said so); a
    directory holding anything else is refused, or replaced whole with `force`."""
    marker = directory / MARKER
    if directory.exists() and not directory.is_dir():
        raise Refusal(f"{directory} is a file; name a directory to write the model into")
    if directory.is_dir() and any(directory.iterdir()):
        previous = _read_marker(marker)
        if previous is not None and previous.get("made") == made:
            progress(
                f"{directory} already holds this {made['maker']} output; nothing to do (--force rebuilds it)"
            )
            return {**previous.get("report", {}), "output": str(directory), "unchanged": True}
        if not force:
            raise Refusal(
                f"{directory} exists and is not empty (it holds another model); choose a new directory, "
                "or give --force to replace it"
            )
        sweep_stale(directory)
        staging = Path(tempfile.mkdtemp(prefix=partial_prefix(directory), dir=directory.parent))
        out = staging / directory.name
        try:
            report = make(out)
            write_json(out / MARKER, {"made": made, "report": report})
            old = Path(tempfile.mkdtemp(prefix=partial_prefix(directory), dir=directory.parent))
            os.replace(directory, old / directory.name)
            os.replace(out, directory)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return {**_rehome(report, out, directory), "replaced": True}
    report = make(directory)
    try:
        write_json(marker, {"made": made, "report": report})
    except OSError:
        # made here (it was absent or empty): no half output
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return report


def _rehome(report: dict, old: Path, new: Path) -> dict:
    return {k: (str(new) if v == str(old) else v) for k, v in report.items()}


def _read_marker(marker: Path) -> dict | None:
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
