"""Releasing a thread's idle OpenMP workers (engine/omp_pool.py): a parallel region opened by a
thread leaves it a team of workers, release_idle_workers() ends them (the process's thread count
drops back), and the token engine releases the workers that its callers' threads make when they work
on in-process ranks (loading, warming up, registering), so that they do not throttle the engine
thread's own team. Each check runs in a fresh
process:
a thread count is only meaningful where nothing else made threads first. A released worker leaves
/proc/self/task a moment after the call returns (it exits on its own), so a count expected to change
is read once it has, or after ten seconds (a loaded CI machine once read it too soon)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
    reason="libgomp's workers, counted in /proc/self/task, on a Linux machine of 2+ CPUs",
)


SETTLE = """
import os, time
threads = lambda: len(os.listdir("/proc/self/task"))
def settled(expected):
    deadline = time.monotonic() + 10
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()
def steady():  # no count expected: the first that holds for half a second
    last = threads()
    for _ in range(20):
        time.sleep(0.5)
        if threads() == last:
            return last
        last = threads()
    return last
"""


def run(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SETTLE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_releasing_ends_the_threads_a_parallel_region_left():
    before, worked, released, again = run("""
        import os, torch
        from ster_dist.engine.omp_pool import release_idle_workers
        torch.set_num_threads(2)
        before = threads()
        torch.randn(4_000_000).sum()  # a parallel region: a worker for the second thread
        worked = threads()
        assert release_idle_workers()
        released = settled(before)
        torch.randn(4_000_000).sum()  # the next region makes its worker again
        print(before, worked, released, threads())
    """)
    assert int(worked) == int(before) + 1
    assert int(released) == int(before)
    assert int(again) == int(before) + 1


def test_the_engine_releases_what_its_callers_threads_made(tmp_path):
    counts = run(f"""
        import os, torch
        from ster_dist.load.toy import make_toy_model
        from tests.engine.test_engine import open_engine
        torch.set_num_threads(2)
        make_toy_model({str(tmp_path / "toy")!r}, layers=2, hidden=64, seed=0)
        engine = open_engine({str(tmp_path / "toy")!r})  # loaded in this thread; its engine thread not yet stepping
        before = steady()
        from ster_dist.engine.omp_pool import release_idle_workers
        release_idle_workers()  # nothing left to release: the engine did when it started
        released = threads()
        torch.randn(4_000_000).sum()  # this thread computes again: its workers come back
        worked = threads()
        with engine.paused():  # as a job that has the ranks from another thread
            pass
        print(before, released, worked, settled(before))
        engine.close()
    """)
    settled, released, worked, after = map(int, counts)
    assert released == settled
    assert worked == settled + 1
    assert after == settled
