"""Releasing a thread's idle OpenMP workers, so that the engine's thread computes without throttled
ones.

torch's CPU kernels (and ster_dist's, kernels/) run on OpenMP, whose runtime (GNU libgomp, which
torch's wheels ship) keeps a team of worker threads for every thread that has opened a parallel
region. When the process holds more such workers than it has CPUs, libgomp stops letting idle
workers spin between two parallel regions (a "throttled" spin of a thousand rounds instead of three
hundred thousand): they sleep, and every region pays their wake-up. An in-process engine makes
exactly that count: the caller's thread loads the model (its team), then the engine's thread runs
the steps (a second team). On the 2-core test machine a batch-1 step of SmolLM2 read its weights
30-60% slower from the engine's thread than from the loading one, until the loading thread's workers
were released (bench/README.md).
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the calling thread's team of workers


def release_idle_workers() -> bool:
    """Free the calling thread's OpenMP workers (OpenMP 5's omp_pause_resource_all); they are made
    again if it opens another parallel region. False where the runtime has no such call (not
    libgomp, or too old)."""
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_HARD) == 0


@functools.cache
def _pause():
    """libgomp's omp_pause_resource_all, looked up once; None without it."""
    try:  # only the copy torch already loaded (the soname is shared): never a second runtime
        runtime = ctypes.CDLL("libgomp.so.1", mode=getattr(os, "RTLD_NOLOAD", 4) | os.RTLD_LAZY)
        pause = runtime.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause
