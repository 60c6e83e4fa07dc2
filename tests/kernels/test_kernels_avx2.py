"""The kernels' AVX2 loops on a CPU with AVX-512.

ster_dist/kernels builds for the CPU it runs on, so on an AVX-512 CPU (as CI's may be) no test
compiled, let alone ran, the AVX2 loops an AVX2-only CPU runs: panels of 16 outputs, bf16 widened as
read, the 256-bit lanes. Here they are built as such a CPU builds them (STER_KERNELS_ISA=avx2) and
the kernels' own tests run over them in a child process, against the same references.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.native_kernels import BUILDABLE
from ster_dist import kernels

ROOT = Path(__file__).resolve().parents[2]
# the kernels' own tests (not those of compiled graphs over them: compiling would double this test's
# time)
KERNEL_TESTS = [
    "tests/kernels/test_argmax_kernel.py",
    "tests/kernels/test_causal_attend.py",
    "tests/kernels/test_few_rows.py",
    "tests/model/test_packed_weights.py",
    "tests/kernels/test_paged_decode.py",
    "tests/model/test_grouped_experts.py",
]


def _has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.slow  # 20-80 s on 2 cores (issue 57: the default suite's budget)
def test_the_kernels_tests_pass_over_the_avx2_loops_on_an_avx512_cpu():
    if not BUILDABLE:
        pytest.skip("no C++ compiler or no AVX2 here: the kernels are not built")
    if not _has_avx512():
        pytest.skip("this CPU has no AVX-512: every kernel test here already runs the AVX2 loops")
    env = {**os.environ, "STER_KERNELS_ISA": "avx2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-q",
            "-rs",
            "-m",
            "not slow",
            *KERNEL_TESTS,
            f"{Path(__file__).relative_to(ROOT)}::test_the_build_is_for_avx2_where_asked",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    said = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, said
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 200, said
    # the check of the build itself ran in the child, and nothing was skipped for want of the
    # kernels
    assert "run in the child process" not in done.stdout, said
    assert "kernels are not built" not in done.stdout, said


def test_the_build_is_for_avx2_where_asked():
    if os.environ.get("STER_KERNELS_ISA") != "avx2":
        pytest.skip("run in the child process of the test above, which asks for the AVX2 build")
    assert kernels.ready()
    assert torch.ops.ster_kernels.isa() == 1  # 1: AVX2 (2 would be AVX-512)


def test_an_unknown_instruction_set_is_said_and_the_build_is_for_this_cpu():
    if not BUILDABLE:
        pytest.skip("no C++ compiler or no AVX2 here: the kernels are not built")
    env = {**os.environ, "STER_KERNELS_ISA": "sse", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from ster_dist import kernels; "
            "print(kernels.ready(), torch.ops.ster_kernels.isa())",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "STER_KERNELS_ISA='sse' is not 'native' or 'avx2': the kernels are built for this CPU"
        in done.stderr
    )
    assert done.stdout.split() == ["True", "2" if _has_avx512() else "1"]
