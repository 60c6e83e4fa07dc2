"""What every command shares: the model and runtime flags, progress events, the driver session
(checkpoint resolved once, tokenizer, config, the ranks), and atomic JSON writes."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ster_dist.errors import Refusal


def progress(message: str, **fields) -> None:
    print(json.dumps({"event": "progress", "time": round(time.time(), 3), "message": message, **fields}),
          file=sys.stderr, flush=True)


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a local model directory or a Hugging Face Hub id")
    p.add_argument("--revision", default=None, help="Hub revision (default main); metadata only for a directory")


def runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (Ray actors when above 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks for mixture-of-experts models (tp x ep ranks in all)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (else RAY_ADDRESS, else a local one)")


class Session:
    """The driver's view of one run: checkpoint resolved once, tokenizer, config, and the ranks."""

    def __init__(self, args):
        from ster_dist.config_load import model_config
        from ster_dist.load import check_device, compute_dtype
        from ster_dist.resolve import resolve
        from ster_dist.tokenizer import Tokenizer
        from ster_dist.workers.group import load_on, open_group

        if args.tp < 1:
            raise Refusal(f"--tp must be 1 or more, got {args.tp}")
        ep = getattr(args, "ep", 1)
        if ep < 1:
            raise Refusal(f"--ep must be 1 or more, got {ep}")
        check_device(args.device)
        compute_dtype(args.precision, args.device)
        progress(f"resolving {args.model}")
        self.checkpoint = resolve(args.model, args.revision)
        self.cfg = model_config(self.checkpoint)
        self.tokenizer = Tokenizer.from_directory(self.checkpoint.directory)
        self.provenance: dict = {}  # what modifiers (vectors, adapters) attached, for output records
        world = args.tp * ep
        where = f"{world} ranks" if world > 1 else "1 Ray actor" if args.address else "this process"
        progress(f"loading {self.checkpoint.weight_format} weights ({len(self.checkpoint.weight_files)} files) "
                 f"in {where}")
        self.group = open_group(args.tp, args.device, args.address, ep=ep)
        try:
            self.loads = load_on(self.group, self.checkpoint, args.precision, args.device)
        except BaseException:
            self.group.close()
            raise

    @property
    def eos(self) -> tuple[int, ...]:
        eos_id = self.tokenizer.eos_token_id
        return self.cfg.eos_token_ids or ((eos_id,) if eos_id is not None else ())

    def close(self) -> None:
        self.group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_POOL = None  # set by the scheduler: keeps sessions (worker groups) alive across jobs


def use_pool(pool) -> None:
    """Route session() through `pool.get(args)` (a scheduler's cache of worker groups); None resets."""
    global _POOL
    _POOL = pool


@contextlib.contextmanager
def session(args):
    """The Session for these args: the scheduler's pooled one when a pool is set (left open for the
    next job), else a fresh one closed on exit."""
    if _POOL is not None:
        yield _POOL.get(args)
        return
    own = Session(args)
    try:
        yield own
    finally:
        own.close()


# Modifiers a run can carry into the ranks before it generates or captures: each is
# (flag attribute, "module:function"); the function attaches its modifier to every rank of the
# session (and to the session's provenance) and returns a detach callable, or refuses.
MODIFIERS = (("vector", "ster_dist.steer.attach:attach_for_cli"),
             ("adapter", "ster_dist.adapters.attach:attach_for_cli"))


@contextlib.contextmanager
def modifiers(session_: "Session", args):
    detach = []
    try:
        for flag, target in MODIFIERS:
            if getattr(args, flag, None) is None:
                continue
            module, _, name = target.partition(":")
            try:
                attach = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                raise Refusal(f"--{flag} is not available in this ster_dist build yet") from None
            detach.append(attach(session_, args))
        yield
    finally:
        for undo in reversed(detach):
            undo()


def read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise Refusal(f"{flag} {path}: {exc.strerror or exc}") from None


def read_json(path: str, flag: str):
    try:
        return json.loads(read_text(path, flag))
    except json.JSONDecodeError as exc:
        raise Refusal(f"{flag} {path} is not JSON: {exc.msg} at line {exc.lineno}") from None


def write_json_atomic(path: Path, data: dict) -> None:
    """Write beside the target, then rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, ensure_ascii=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
