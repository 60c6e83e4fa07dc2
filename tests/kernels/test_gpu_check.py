"""bench/gpu_check.py --dry-run: every step of the prepared device check runs on the CPU under
Triton's interpreter (kernels against references, greedy parity under each --kernels, the decode and
FP8 GEMM drives) and its one JSON report says all passed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about 100 s here: two tiny families under three kernel choices, interpreted
def test_gpu_check_dry_run_passes_every_step(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run", f"--output={report}"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env={**os.environ},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed == json.loads(report.read_text())
    assert printed["ok"] and printed["dry_run"], printed
    assert len(printed["kernels"]) == 10 and all(k["ok"] for k in printed["kernels"].values())
    assert all(p["equal"] for p in printed["parity"].values())
    assert printed["parity"]["llama"]["answers"]["triton"][0]  # real answers, not empty lists
    assert len(printed["decode"]["runs"]) == 8
