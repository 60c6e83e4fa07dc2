"""Node-aware placement on a real two-node Ray cluster on this machine (`ray start --head` and a
second raylet joined with --address, each with its own --resources): each tensor-parallel group of a
TP2 x PP2 group sits inside one node, the stages on different nodes, and the text equals one rank's;
a group no node can hold is refused at once; a killed stage fails the call as WorkerLost, and the
job queue retries a job whose stage died on a restarted group."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ster_dist.errors import Refusal, WorkerLost
from ster_dist.load import load_model
from ster_dist.resolve import resolve
from tests.engine_checks import engine_tokens
from tests.tiny_models import make_tiny

ray = pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `ray start --address` refuses to join a node while RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is 0, and
# with it 1 every
# node leaves 127.0.0.1 for the host's routable address. The second raylet is started by Ray's own
# CLI with that
# one check switched off, so both nodes stay on loopback.
_JOIN_ON_LOOPBACK = """
import sys, types
from ray._private import ray_constants
from ray.scripts import scripts
joinable = types.ModuleType("ray_constants")
joinable.__dict__.update(vars(ray_constants))
joinable.ENABLE_RAY_CLUSTER = True
scripts.ray_constants = joinable
sys.argv = ["ray", *sys.argv[1:]]
scripts.main()
"""


def _ray_start(args: list[str], env: dict, join: bool = False) -> subprocess.Popen:
    command = (
        [sys.executable, "-c", _JOIN_ON_LOOPBACK]
        if join
        else [str(Path(sys.executable).parent / "ray")]
    )
    return subprocess.Popen(
        [*command, "start", "--block", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    # `ray start --block` took 10 s on SIGTERM here; what is left is killed below, found by the temp
    # dir
    try:
        proc.wait(3)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="module")
def two_nodes():
    """Two raylets of 2 CPUs each, on 127.0.0.1, stopped by signalling only the processes they
    started."""
    temp = Path(f"/tmp/rp{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
    gcs = _free_port()
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    common = [
        "--node-ip-address",
        "127.0.0.1",
        "--num-cpus",
        "2",
        "--disable-usage-stats",
        "--object-store-memory",
        str(100 * 1024 * 1024),
    ]
    procs = [
        _ray_start(
            [
                "--head",
                "--port",
                str(gcs),
                "--include-dashboard",
                "false",
                "--temp-dir",
                str(temp),
                "--ray-client-server-port",
                str(_free_port()),
                "--resources",
                json.dumps({"node_a": 1}),
                *common,
            ],
            env,
        )
    ]
    from ray._private import ray_constants

    loopback = ray_constants.ENABLE_RAY_CLUSTER
    try:
        deadline = time.monotonic() + 90
        # the head's GCS first: the second raylet and the driver join through it
        while not _answers(gcs):
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError("the test's Ray head did not come up")
            time.sleep(0.5)
        procs.append(
            _ray_start(
                [
                    "--address",
                    f"127.0.0.1:{gcs}",
                    "--resources",
                    json.dumps({"node_b": 1}),
                    *common,
                ],
                env,
                join=True,
            )
        )
        ray_constants.ENABLE_RAY_CLUSTER = False  # keep 127.0.0.1 (Ray read the switch at import)
        ray.init(address=f"127.0.0.1:{gcs}", log_to_driver=False, configure_logging=False)
        deadline = time.monotonic() + 90
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the test's two Ray nodes did not come up")
            time.sleep(0.5)
        yield f"127.0.0.1:{gcs}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = loopback
        for proc in reversed(procs):
            _stop(proc)
        out = subprocess.run(["pgrep", "-f", str(temp)], capture_output=True, text=True).stdout
        for pid in (int(p) for p in out.split() if int(p) != os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny("llama", directory)
    return resolve(str(directory))


def test_each_tp_group_sits_inside_one_node_and_the_stages_generate_one_ranks_text(
    two_nodes, llama
):
    from ster_dist.workers.ray_group import RayGroup

    single = load_model(llama, "f32")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    with RayGroup(4, address=two_nodes, pp=2) as group:
        where = group.call("whereabouts")
        group.call("load", llama, "f32", "cpu")
        tokens = engine_tokens(group, prompts, 8, (), llama)
    nodes = [w["node"] for w in where]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert tokens == engine_tokens(single, prompts, 8)


def test_a_tp_group_no_node_can_hold_is_refused_at_once(two_nodes):
    from ster_dist.workers.ray_group import RayGroup

    start = time.monotonic()
    with pytest.raises(
        Refusal,
        match="for a tensor-parallel group of 4 ranks, which must sit inside one node; lower --tp",
    ):
        RayGroup(4, address=two_nodes)
    assert time.monotonic() - start < 30


def test_a_killed_stage_fails_the_call_as_worker_lost(two_nodes, llama):
    from ster_dist.workers.ray_group import RayGroup

    group = RayGroup(2, address=two_nodes, pp=2)
    group.call("load", llama, "f32", "cpu")
    ray.kill(group.actors[1])
    with pytest.raises(WorkerLost, match="rank 1 died during logits"):
        group.call("logits", torch.tensor([[5, 6, 7]]))
    assert group.actors == []


# two groups started on the two-node cluster and a held job: about a minute on two cores
@pytest.mark.slow
def test_a_job_whose_stage_dies_is_retried_on_a_restarted_group(two_nodes, llama, tmp_path):
    """The job queue's own retry: a generate job at --pp 2 held mid-attempt, its second stage's rank
    killed; the job runs again on a new group and answers as one rank does."""
    from ster_dist.jobqueue.queue import JobQueue
    from tests.cli_run import cli_generate
    from tests.held_vector import HeldVector

    directory = str(llama.directory)
    held = HeldVector(tmp_path, directory)
    with JobQueue(None, address=two_nodes, max_retries=1) as scheduler:
        job_id = scheduler.submit({**held.job(directory, "a held answer"), "pp": 2})
        finished = lambda: scheduler.poll(job_id)["result"]  # noqa: E731
        fd = held.wait_for_reader(finished)  # attempt 1 holds its group
        group = [g for g in scheduler.stats()["groups"] if g["model"] == directory][0]
        victim = group["workers"][1]["pid"]  # the second stage's rank
        os.kill(victim, signal.SIGKILL)
        held.release(fd)
        cursor, deadline, seen = 0, time.monotonic() + 120, []
        while not any(e.get("message", "").startswith("a worker died: rank 1 died") for e in seen):
            assert time.monotonic() < deadline and finished() is None, [
                e.get("message") for e in seen
            ]
            reply = scheduler.poll(job_id, cursor, 1.0)
            seen, cursor = seen + reply["events"], reply["cursor"]
        held.release(held.wait_for_reader(finished))  # attempt 2, on a restarted group
        record = scheduler.wait(job_id, 180)
    assert record["status"] == "done" and record["attempts"] == 2, record.get("error")
    reference = cli_generate(
        f"--model={directory}",
        "--prompt=a held answer",
        "--max-new-tokens=12",
        "--chat-template=off",
    )
    assert record["result"]["text"] == reference["text"]
