"""Settings every test process shares.

Ray reads its token-authentication mode once per process, so a process that talks to two local
clusters (an embedded one a test started, then the `ray start --head` one of test_ray_jobs.py)
must see one mode for both: the actors it creates on the second die at start when the modes
differ. Every cluster here is ours, on 127.0.0.1, so authentication is off for all of them.

`tp2` and `ep2`: a spawned gloo group of two tensor-parallel ranks, and one of two expert-parallel ranks,
each shared by the tests of one module.

STER_ENFORCE_EAGER: every test process (and the ranks and commands it starts) runs its steps eagerly.
"""

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Compiling a model's layers (model/compiled.py) costs seconds on these 2 cores, and an engine compiles once
# it has run 128 steps: the suite runs eager, and tests/test_compiled_step.py lifts this to test compiling.
os.environ.setdefault("STER_ENFORCE_EAGER", "1")


@pytest.fixture(scope="module")
def tp2():
    from ster_dist.workers.spawn import SpawnGroup

    with SpawnGroup(2) as group:
        yield group


@pytest.fixture(scope="module")
def ep2():
    from ster_dist.workers.spawn import SpawnGroup

    with SpawnGroup(2, ep=2) as group:
        yield group
