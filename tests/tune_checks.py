"""Helpers the tune tests (test_tune_preference.py, test_tune_grpo.py) share: JSONL input files, the
command line run in-process, and the relative difference of two tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ster_dist.cli import main


def write_jsonl(path: Path, rows: list) -> Path:
    """One line per row: a string as written (a malformed line on purpose), anything else as JSON."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_cli(capsys, *argv) -> tuple[int, dict | None, str]:
    """(exit code, the JSON result on success, stderr) of `ster argv...` run in this process."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if code == 0 else None), captured.err


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
