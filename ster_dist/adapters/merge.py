"""Streaming LoRA merges: the base read tensor by tensor and written back in its own layout.

A merge never builds a decoder and never holds the model. `prepare` resolves the base, runs every
refusal (adapter for another model or width, targets the family cannot take, a GGUF or FP8 base, a
source naming one tensor twice, a checkpoint the loader would not load) and plans the output shards
from the safetensors headers alone. Each output shard is then written by shard/writer.write_shard:
unadapted tensors are copied byte for byte, adapted ones get (alpha / r) * B @ A (alpha / sqrt(r)
under rsLoRA) accumulated in f32 and cast back to their source dtype, in row blocks, so peak memory
is a few blocks of the largest adapted tensor.

A base in Mistral's own format is written back in it: consolidated*.safetensors under Mistral's
tensor names (the same name map that loads it places the updates) beside its params.json.

Everything is written into a work directory beside the output (.NAME.merging) and renamed into
place only when complete: a killed merge leaves no output directory. The work directory keeps
the shards already finished, with a fingerprint of the base, the adapter and the shard plan, so
a rerun (or a batch job resumed on a cluster, jobs/merge.py) writes only the rest. A write that
fails for want of space is the exception: it ends in one refusal line and removes the work
directory, since the space its finished shards hold is what the rerun needs.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ster_dist.adapters.format import open_adapter
from ster_dist.adapters.targets import (
    check_model,
    decoder_shards,
    load_sites,
    plan_sites,
    refuse_family,
    summary,
)
from ster_dist.atomic import finish_dir, refusing_full_disk, write_json
from ster_dist.checkpoint import Checkpoint
from ster_dist.errors import Refusal
from ster_dist.inputs import not_an_input
from ster_dist.shard.safetensors_header import entries, read_header
from ster_dist.shard.writer import (
    OutTensor,
    Update,
    placements,
    shard_header,
    shard_names,
    shard_size,
    split_shards,
    write_shard,
)

DEFAULT_MAX_SHARD = "5GB"
STATE = ".merge-state.json"
# copied beside the shards, after the base's own config file (config.json, or Mistral's params.json)
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "tekken.json",
)
# the output shards' file stem per base format: the resolver reads consolidated* only beside
# params.json
SHARD_STEMS = {"safetensors": "model", "mistral": "consolidated"}
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
Progress = Callable[..., None]


def _quiet(message: str, **fields) -> None:
    pass


@dataclass
class MergePlan:
    """A merge ready to write: its output shards, which of them are still to write, and the report
    so far."""

    checkpoint: Checkpoint
    output: Path
    work: Path
    shards: list[list[OutTensor]]
    names: list[str]
    pending: list[int]
    side_files: list[Path]
    report: dict = field(default_factory=dict)
    stem: str = "model"  # the shards' file stem: model, or consolidated for Mistral's format

    def shard_path(self, index: int) -> Path:
        return self.work / self.names[index]


def parse_size(text: str | int) -> int:
    """'5GB' (10^9, as Transformers reads it), '500MiB' (2^20), or plain bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if m is None:
        raise Refusal(f"--max-shard-size {text!r} is not a size; write it like 5GB, 500MB or 2GiB")
    number, unit, suffix = float(m.group(1)), m.group(2), m.group(3) or "B"
    base = 1024 if suffix == "IB" else 1000
    size = int(number * base ** " KMGT".index(unit or " "))
    if size <= 0:
        raise Refusal(f"--max-shard-size {text!r} must be positive")
    return size


def prepare(
    model: str,
    adapter_path: str,
    output: str | Path,
    revision: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    checkpoint: Checkpoint | None = None,
) -> MergePlan:
    """Every refusal, the shard plan and the resume state; reads headers and the adapter only."""
    from ster_dist.config.file import family_of
    from ster_dist.config.load import model_config
    from ster_dist.resolve import gate_view, resolve
    from ster_dist.shard.plan import build_plan

    max_bytes = parse_size(max_shard_size)
    output = Path(output)
    if output.exists():
        raise Refusal(f"output {output} already exists; remove it or choose another --output")
    # batch merges (jobs/merge.py) come here without ops.merge's check: never into what is read
    not_an_input(
        str(output), "output", [("model", "model", model), ("adapter", "adapter", adapter_path)]
    )
    adapter = open_adapter(adapter_path)
    check_model(adapter, model)
    if checkpoint is None:
        checkpoint = resolve(model, revision)
    if checkpoint.weight_format == "gguf":
        raise Refusal(
            f"{model} is a GGUF checkpoint; an adapter is merged into safetensors weights only. Run the "
            "adapter on it unmerged (--adapter), or merge into the base model's safetensors release"
        )
    if checkpoint.weight_format not in SHARD_STEMS:
        raise Refusal(
            f"{model} is in {checkpoint.weight_format} format; this ster_dist build merges "
            "Transformers-format or Mistral-format safetensors checkpoints only"
        )
    refuse_family(family_of(gate_view(checkpoint.raw_config, checkpoint.weight_format)))
    side = side_files(checkpoint)  # refused here, before the work directory exists
    cfg = model_config(checkpoint)
    if cfg.quant is not None:  # its weights are quantized: a merge would have to requantize them
        raise Refusal(
            f"{model} is {cfg.quant.describe()}; merge onto {cfg.quant.label} is not supported: merge "
            "into a BF16 export of the model"
        )
    shards = decoder_shards(cfg)
    plans = plan_sites(adapter, cfg, shards)
    entries = index_weights(list(checkpoint.weight_files))
    # the loader's own checks: a tensor no rule maps, a tensor the config turns off, a shape unlike
    # the config's
    build_plan(cfg.spec, cfg, shards, {name: e["shape"] for name, e in entries.items()})
    where = placements(cfg.spec, cfg, list(entries), {p.param for p in plans})
    for plan in plans:
        if plan.param not in where:
            raise Refusal(
                f"checkpoint has no tensor holding the {plan.target} projection of layer {plan.layer} "
                f"({plan.param}) to merge into"
            )
    updates: dict[str, list[Update]] = {}
    for site in load_sites(adapter, plans):
        placed = where[site.param]
        updates.setdefault(placed.tensor, []).append(
            Update(site.a, site.b, site.scale, placed.runs)
        )
    transposed = {p.tensor for p in where.values() if p.transposed}
    tensors = []
    for name, e in entries.items():
        if name in updates and e["dtype"] not in _FLOAT_DTYPES:
            raise Refusal(
                f"checkpoint tensor {name} is {e['dtype']}; an adapter merges into float weights only"
            )
        tensors.append(
            OutTensor(
                name,
                e["dtype"],
                e["shape"],
                e["file"],
                e["offset"],
                e["nbytes"],
                name in transposed,
                tuple(updates.get(name, ())),
            )
        )
    out_shards = split_shards(tensors, max_bytes)
    stem = SHARD_STEMS[checkpoint.weight_format]
    names = shard_names(len(out_shards), stem)
    work = work_dir(output)
    fingerprint = _fingerprint(checkpoint, adapter.files(), out_shards)
    pending = _resume(work, fingerprint, names, out_shards)
    merged = [t for t in tensors if t.updates]
    dtypes = sorted({t.dtype for t in merged})
    report = {
        "model": model,
        "model_revision": checkpoint.model_revision or adapter.model_revision,
        "adapter": str(adapter_path),
        "output": str(output),
        "format": adapter.format,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "scale": adapter.scale,
        "use_rslora": adapter.use_rslora,
        "patterns": adapter.patterns,
        **summary(plans),
        "hidden_size": cfg.hidden_size,
        "merged_tensors": len(merged),
        "copied_tensors": len(tensors) - len(merged),
        "total_tensors": len(tensors),
        "parameters": sum(math.prod(t.shape) for t in tensors),
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "shards": len(out_shards),
        "resumed_shards": len(out_shards) - len(pending),
    }
    return MergePlan(checkpoint, output, work, out_shards, names, pending, side, report, stem)


def work_dir(output: Path) -> Path:
    """Where a merge into `output` is written before its rename (kept across runs to resume)."""
    return output.parent / f".{output.name}.merging"


def side_files(checkpoint: Checkpoint) -> list[Path]:
    """The config and tokenizer files to copy beside the shards, each inside the model's own files.

    A side file is copied by its content, so a symlink out of the model directory
    (tokenizer_config.json -> ~/.ssh/id_rsa) would carry whatever it names into the merged
    output."""
    files = [checkpoint.config_path] + [
        checkpoint.directory / n for n in SIDE_FILES if (checkpoint.directory / n).is_file()
    ]
    root = _model_root(checkpoint)
    for path in files:
        if not path.resolve().is_relative_to(root):
            raise Refusal(
                f"{path} is a symlink to {path.resolve()}, outside the model directory; "
                "replace it with the file itself"
            )
    return files


def _model_root(checkpoint: Checkpoint) -> Path:
    """Where the model's files may live: its directory, or for a Hub snapshot the repository's cache
    folder, whose snapshots/<sha>/ links into blobs/."""
    directory = checkpoint.directory.resolve()
    return directory.parent.parent if checkpoint.source == "hub" else directory


def write_one(plan: MergePlan, index: int) -> int:
    """Write output shard `index` into the work directory; returns the bytes written."""
    return write_shard(plan.shard_path(index), plan.shards[index])


def finish(plan: MergePlan) -> dict:
    """Index, config and tokenizer files beside the shards, then the rename into place."""
    for index, name in enumerate(plan.names):
        path = plan.shard_path(index)
        if not path.is_file() or path.stat().st_size != shard_size(plan.shards[index]):
            raise Refusal(
                f"merge shard {name} is missing or incomplete in {plan.work}; rerun the merge"
            )
    weight_map = {t.name: name for name, shard in zip(plan.names, plan.shards) for t in shard}
    total = sum(t.nbytes for shard in plan.shards for t in shard)
    write_json(
        plan.work / f"{plan.stem}.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )
    for path in plan.side_files:
        shutil.copyfile(path, plan.work / path.name)
    (plan.work / STATE).unlink(missing_ok=True)
    if plan.output.exists():
        raise Refusal(
            f"output {plan.output} appeared while merging; the merge is kept in {plan.work}"
        )
    finish_dir(plan.work, plan.output)
    files = sorted(p.name for p in plan.output.iterdir())
    return {**plan.report, "files": files}


def merge(
    model: str,
    adapter: str,
    output: str | Path,
    revision: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    progress: Progress = _quiet,
) -> dict:
    """Merge in this process, shard after shard."""
    start = time.perf_counter()
    # its state file is written here
    with refusing_full_disk(output, cleanup=[work_dir(Path(output))]):
        plan = prepare(model, adapter, output, revision, max_shard_size)
    if plan.report["resumed_shards"]:
        progress(
            f"resuming: {plan.report['resumed_shards']} of {len(plan.names)} shards already written"
        )
    written = 0
    needed = sum(shard_size(shard) for shard in plan.shards)
    with refusing_full_disk(plan.output, needed, cleanup=[plan.work]):
        for done, index in enumerate(plan.pending, 1):
            written += write_one(plan, index)
            progress(
                f"wrote {plan.names[index]}", shard=done, shards=len(plan.pending), bytes=written
            )
        report = finish(plan)
    seconds = time.perf_counter() - start
    return {**report, "bytes_written": written, "seconds": round(seconds, 3)}


# ---- source headers --------------------------------------------------------------------------


def index_weights(files: list[Path]) -> dict[str, dict]:
    """Every tensor of the weight files: file, data offset, size, dtype and shape, in file and data
    order.

    A tensor named twice — in one header or in two files — is refused rather than half-merged.
    """
    found: dict[str, dict] = {}
    for path in files:
        path = Path(path)
        listed = entries(path)  # read_header refuses a name stated twice in one header
        for entry in listed:
            if entry.name in found:
                raise Refusal(
                    f"model weight {entry.name} appears in more than one weight file "
                    f"({found[entry.name]['file'].name} and {path.name}); remove the duplicate shard"
                )
        # data order: the copy reads each file forwards
        for entry in sorted(listed, key=lambda e: e.offset):
            found[entry.name] = {
                "file": path,
                "offset": entry.offset,
                "nbytes": entry.nbytes,
                "dtype": entry.dtype,
                "shape": entry.shape,
            }
    return found


# ---- resume ----------------------------------------------------------------------------------


def _fingerprint(
    checkpoint: Checkpoint, adapter_files: list[Path], shards: list[list[OutTensor]]
) -> str:
    """What the finished shards depend on: the base files (size and time), the adapter (its bytes),
    the plan."""
    digest = hashlib.sha256()
    for path in checkpoint.weight_files:
        stat = Path(path).stat()
        digest.update(f"{Path(path).name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for path in adapter_files:
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    for shard in shards:
        digest.update(hashlib.sha256(shard_header(shard)).digest())
    return digest.hexdigest()


def _resume(
    work: Path, fingerprint: str, names: list[str], shards: list[list[OutTensor]]
) -> list[int]:
    """Shard indices still to write; a work directory of another merge is cleared first."""
    state = work / STATE
    try:
        same = json.loads(state.read_text()).get("fingerprint") == fingerprint
    except (OSError, ValueError):
        same = False
    if work.exists() and not same:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    # a shard (or state file) a killed writer left half-written beside its name
    for stale in work.glob(".*"):
        if stale.name != STATE:
            stale.unlink(missing_ok=True)
    if not same:
        write_json(state, {"fingerprint": fingerprint, "shards": names})
    pending = []
    for index, name in enumerate(names):
        path = work / name
        if not (
            path.is_file()
            and path.stat().st_size == shard_size(shards[index])
            and _header_matches(path, shards[index])
        ):
            pending.append(index)
    return pending


def _header_matches(path: Path, shard: list[OutTensor]) -> bool:
    expected = shard_header(shard)
    with open(path, "rb") as handle:
        return handle.read(len(expected)) == expected
