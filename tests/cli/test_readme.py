"""The README's "Using it" blocks, run as written: every ```bash block, in order, from a copy of the
repository's root (its jobs/ and README beside a stand-in for the main job's models/smollm2: what
`ster gguf-import` makes of a small Q4_1 .gguf with SmolLM2's 30 layers, so the example specs' layer
numbers hold, and its 9 query and 3 key-value heads, so `--tp 2` splits them unevenly as on the real
model) with `.venv/bin/ster`,
`.venv/bin/python` and `.venv/bin/pip` standing for this interpreter's. A block that fails fails
the test with its command and stderr.

`.venv/bin/ster` is tests/forked_cli.py's client: each command line runs `python -m ster_dist.cli`'s
module in a process of its own, forked from one that imported the command line once, so the
thirty-odd commands do not each spend seconds importing torch (`python -m ster_dist.cli` as a new
interpreter runs in test_cli.py, test_ray_group.py, test_submit_local.py and others)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gguf import GGMLQuantizationType

from ster_dist.gguf import import_gguf
from tests.gguf_fixtures import write_llama

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def bash_blocks() -> list[str]:
    return BLOCK.findall((REPO / "README.md").read_text(encoding="utf-8"))


def _shim(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture(scope="module")
def forked_cli():
    """The server the `ster` shim asks for each command; its socket path is short, as AF_UNIX
    needs."""
    with tempfile.TemporaryDirectory(prefix="ster-cli-") as directory:
        path = str(Path(directory) / "socket")
        server = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "forked_cli.py"), "serve", path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "ready", "tests/forked_cli.py did not start"
            yield path
        finally:
            server.terminate()
            server.wait(30)


@pytest.fixture(scope="module")
def root(tmp_path_factory, forked_cli) -> Path:
    root = tmp_path_factory.mktemp("readme")
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    _shim(
        venv / "ster",
        f'exec "{sys.executable}" "{REPO / "tests" / "forked_cli.py"}" "{forked_cli}" "$@"',
    )
    _shim(venv / "python", f'exec "{sys.executable}" "$@"')
    _shim(venv / "pip", "exit 0  # the test's interpreter has the test extra already")
    (root / "jobs").symlink_to(REPO / "jobs")
    # the main job's first command imports a .gguf: the directory holds it beside its config and
    # tokenizer
    write_llama(
        root / "smollm2.gguf",
        hidden=288,
        heads=9,
        kv_heads=3,
        inter=96,
        layers=30,
        qtype=GGMLQuantizationType.Q4_1,
        scale=0.02,
        context=2048,
    )
    import_gguf(root / "smollm2.gguf", root / "models" / "smollm2")
    return root


def test_the_readme_has_runnable_blocks():
    blocks = bash_blocks()
    assert len(blocks) >= 5 and all(".venv/bin/" in block for block in blocks)


def test_every_readme_block_runs_as_written(root):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    for index, block in enumerate(bash_blocks()):
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
        assert done.returncode == 0, (
            f"README block {index} failed:\n{block}\nstderr:\n{done.stderr[-3000:]}"
        )
        for line in done.stderr.splitlines():  # progress is one JSON object per line, whatever ran
            assert line.startswith("{"), f"README block {index}: stderr line is not JSON: {line!r}"
    scratch = root / "scratch"
    for made in (
        "answers.json",
        "hidden.safetensors",
        "calm.json",
        "truthful.ster.json",
        "sea.ster.json",
        "adapter",
        "merged",
        "merged-job",
        "dpo",
        "reward",
    ):
        assert (scratch / made).exists(), made
