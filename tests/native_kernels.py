"""The package's C++ kernels (ster_dist/kernels) as the tests reach them: whether they can be built
here, and each operator, the test skipped, saying what runs instead, where they cannot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from ster_dist import kernels


def _has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


BUILDABLE = shutil.which(os.environ.get("CXX", "c++")) is not None and _has_avx2()


def built(op: str, instead: str):
    """torch.ops.ster_kernels.<op>; the test is skipped where the kernels cannot be built
    (`instead`: what runs)."""
    if not BUILDABLE:
        pytest.skip(f"no C++ compiler or no AVX2 here: the kernels are not built and {instead}")
    assert kernels.ready()  # a compiler and AVX2 are here: the build must succeed
    return getattr(torch.ops.ster_kernels, op)
