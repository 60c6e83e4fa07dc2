"""Where the kernels' build is found: by what it is made of, not by where its sources lie.

A Ray job runs from an uploaded copy of its working directory, a new path each submission; a build
named by the sources' path rebuilt the kernels (tens of seconds on two cores) in every such job and
then again in every process of the original tree. Here a copy of the package elsewhere finds the
finished build with the compiler taken away, and a copy whose sources differ by one byte does not:
it tries to build its own. And a builder killed mid-build leaves nothing the next one waits on.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ster_dist import kernels
from tests.native_kernels import built

ROOT = Path(__file__).resolve().parents[2]
CHILD = (
    "import ster_dist, torch\n"
    "from ster_dist import kernels\n"
    "print(ster_dist.__file__)\n"
    "print(kernels.ready())\n"
)


def _run_from(copy: Path) -> tuple[list[str], str]:
    # no compiler: a process that would build fails to, and says so
    env = {**os.environ, "CXX": "/bin/false", "PYTHONPATH": str(copy)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split(), done.stderr


def test_a_copy_elsewhere_finds_the_build_and_other_sources_do_not(tmp_path):
    built("few_rows", "nothing to find")  # this tree's build, finished
    copy = tmp_path / "uploaded"
    shutil.copytree(
        ROOT / "ster_dist", copy / "ster_dist", ignore=shutil.ignore_patterns("__pycache__")
    )
    (where, ready), said = _run_from(copy)
    assert where == str(copy / "ster_dist" / "__init__.py")
    assert ready == "True" and "could not be built" not in said, said

    header = copy / "ster_dist" / "kernels" / "lanes.h"
    header.write_text(header.read_text() + "\n")
    (_, ready), said = _run_from(copy)
    assert ready == "False" and "CPU kernels could not be built" in said, said
    # said before the wait, not only after
    assert "building ster_dist's CPU kernels for this CPU" in said


@pytest.mark.slow  # 20-80 s on 2 cores (issue 57: the default suite's budget)
def test_a_builder_killed_mid_build_leaves_no_lock_that_the_next_waits_on(tmp_path):
    """torch's builder locks a build with a file it deletes when done; a builder killed mid-build
    (SIGKILL: a rank killed, a job past its timeout) leaves it, and every later build of that
    directory waited on it forever. Here the build is unfinished again and torch's lock is left as
    such a builder leaves it: the next process builds (a no-op for ninja: every object is there) and
    loads, in bounded time."""
    built("few_rows", "nothing to build")
    with _unfinished() as directory:
        stale = directory / "lock"
        stale.touch()
        try:
            done = subprocess.run(
                [sys.executable, "-c", CHILD],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert done.returncode == 0 and done.stdout.split()[1] == "True", done.stderr
            assert (directory / "finished").is_file() and not stale.exists()
        finally:
            stale.unlink(missing_ok=True)


def test_a_process_that_waits_for_another_builder_says_so_and_loads_its_build(tmp_path):
    built("few_rows", "nothing to build")
    with _unfinished() as directory:
        with open(directory / "building", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # as a builder holds it
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            said = _lines_until(child, "another process is building ster_dist's CPU kernels", 120)
            assert "another process is building" in said[-1], said
            (directory / "finished").touch()  # the build this process "made"
        out, rest = child.communicate(timeout=120)
        assert child.returncode == 0 and out.split()[1] == "True", rest


@contextlib.contextmanager
def _unfinished():
    """This process's build directory with its finished mark taken away, and the mark put back
    after."""
    directory = kernels.build_directory()
    finished = directory / "finished"
    finished.unlink()
    try:
        yield directory
    finally:
        finished.touch()


def _lines_until(child: subprocess.Popen, text: str, seconds: float) -> list[str]:
    """The child's stderr lines up to the first holding `text`; the child killed and the test failed
    at the deadline, so a child that never says it fails rather than hangs."""
    lines, deadline = [], time.monotonic() + seconds
    while not lines or text not in lines[-1]:
        ready, _, _ = select.select([child.stderr], [], [], max(0.0, deadline - time.monotonic()))
        line = child.stderr.readline() if ready else ""
        if not line:
            child.kill()
            raise AssertionError(f"the child did not say {text!r} in {seconds:.0f} s: {lines}")
        lines.append(line)
    return lines


def test_the_build_estimate_is_the_last_timed_build_here(tmp_path):
    assert kernels.build_estimate(tmp_path) == "no earlier build here was timed"
    # b: not timed
    for name, text, age in (
        ("ster_kernels_a", "141.2\n", 100),
        ("ster_kernels_b", "", 0),
        ("ster_kernels_c", "37.6\n", 200),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "finished").write_text(text)
        os.utime(tmp_path / name / "finished", (time.time() - age, time.time() - age))
    assert kernels.build_estimate(tmp_path) == "the last build here took 141 s"  # a is newer than c
