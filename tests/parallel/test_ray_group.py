"""The Ray worker group on a real local Ray cluster: ranks as actors forming a gloo group,
the CLI end to end with --tp 2, and a killed actor surfacing as one error with the group
shut down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from ster_dist.errors import WorkerLost
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.tiny_models import make_tiny

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma2")
    make_tiny("gemma2", directory)
    return directory


def test_ray_ranks_match_one_rank(cluster, gemma2):
    from ster_dist.workers.ray_group import RayGroup

    checkpoint = resolve(str(gemma2))
    ids = torch.randint(3, 300, (2, 30), generator=torch.Generator().manual_seed(0))
    with RayGroup(2) as group:
        stats = group.call("load", checkpoint, "f32", "cpu")
        assert [s["rank"] for s in stats] == [0, 1]
        logits = group.call("logits", ids)[0]
    with torch.no_grad():
        expected = load_model(checkpoint, "f32").model(ids)
    assert compare(logits, expected)["max_relative_error"] < 1e-5


def test_a_killed_actor_is_one_error_and_the_group_shuts_down(cluster, gemma2):
    from ster_dist.workers.ray_group import RayGroup

    group = RayGroup(2)
    group.call("load", resolve(str(gemma2)), "f32", "cpu")
    ray.kill(group.actors[1])
    with pytest.raises(WorkerLost, match=r"rank 1 died during logits: .*the group was shut down"):
        group.call("logits", torch.ones(1, 3, dtype=torch.long))
    assert group.actors == [] and group.pgs == []


def _ster(*argv, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", "ster_dist.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    return proc


def _generate_args(gemma2) -> list[str]:
    return [
        "generate",
        "--model",
        str(gemma2),
        "--prompt",
        "the capital of France",
        "--max-new-tokens",
        "8",
        "--chat-template",
        "off",
    ]


@pytest.fixture(scope="module")
def one_rank(gemma2):
    """`ster generate` of _generate_args at one rank: the answer both command-line tests compare
    with."""
    return _ster(*_generate_args(gemma2))


# about 30 s on 2 cores: a second command line at --tp 2 with its own embedded cluster
@pytest.mark.slow
def test_cli_generate_with_tp2_on_a_local_ray_cluster_equals_tp1(gemma2, one_rank):
    """The default run's twin is the next test: the same `ster generate --tp 2` on an embedded
    cluster, answering (text and token count) as one rank does; test_readme.py runs `ster generate
    --tp 2` as the README writes it, every stderr line a JSON event."""
    args = _generate_args(gemma2)
    one = one_rank
    two = _ster(*args, "--tp", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert (
        b["tp"] == 2 and a["text"] == b["text"] and a["completion_tokens"] == b["completion_tokens"]
    )
    # Ray's own notices arrive as log events, never as plain text
    for line in two.stderr.splitlines():
        assert isinstance(json.loads(line), dict), line
    leftover = subprocess.run(
        ["pgrep", "-f", "raylet"], capture_output=True, text=True
    ).stdout.strip()
    assert leftover == "" or ray.is_initialized(), "the CLI left a Ray cluster running"


def test_a_rank_killed_under_a_command_line_is_restarted_and_the_command_completes(
    gemma2, one_rank, tmp_path
):
    """`ster generate --tp 2` runs as a job of an in-process scheduler: a rank killed while the
    command holds its group is retried on a restarted group, and the command prints the answer an
    undisturbed run prints."""
    import threading

    import psutil

    from tests.held_vector import HeldVector

    held = HeldVector(tmp_path, str(gemma2))
    args = _generate_args(gemma2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ster_dist.cli", *args, "--tp", "2", *held.flags()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True
    )
    reader.start()
    try:
        fd = held.wait_for_reader()  # the command is inside its attempt, holding its two ranks
        ranks = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if p.name().startswith("ray::Rank")
        ]
        assert len(ranks) == 2, [
            p.name() for p in psutil.Process(proc.pid).children(recursive=True)
        ]
        ranks[1].kill()
        ranks[1].wait(30)
        held.release(fd)
        deadline = time.monotonic() + 120
        while not any("a worker died: rank" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            time.sleep(0.1)
        held.release(held.wait_for_reader())  # the retry, on a restarted group
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    assert proc.returncode == 0, "".join(lines)
    died = [line for line in lines if "a worker died: rank" in line]
    assert len(died) == 1 and "died during ModelRunner.register_vector" in died[0]
    assert one_rank.returncode == 0, one_rank.stderr
    result, plain = json.loads(out), json.loads(one_rank.stdout)
    assert (
        result["tp"] == 2
        and result["text"] == plain["text"]
        and result["steering"]["strength"] == 1.0
    )
    assert result["completion_tokens"] == plain["completion_tokens"]


def test_a_rank_out_of_memory_is_reported_whole_with_its_own_exit_status(cluster):
    from ster_dist.errors import OutOfMemory
    from ster_dist.workers.ray_group import RayGroup
    from tests.rank_faults import AllocatesTooMuch

    with RayGroup(2) as group:
        with pytest.raises(OutOfMemory) as raised:
            group.on(AllocatesTooMuch).allocate()
    message = str(raised.value)
    assert raised.value.exit_code == 3 and "\n" not in message
    assert (
        message.startswith("rank ")
        and "ran out of memory during AllocatesTooMuch.allocate: MemoryError" in message
    )
    assert message.endswith("or load a smaller precision")  # never cut mid-word
