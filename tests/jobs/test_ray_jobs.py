"""Ray job submission on a real local Ray cluster (`ray start --head` on 127.0.0.1, started for
this module and stopped after): `ray job submit ... jobs/run.py` of generate and merge jobs,
`ster submit` as its thin wrapper, a worker killed mid-job (the job completes on a restarted
group), and the scheduler actor's process killed (Ray restarts it; its journal finishes every
accepted job, none twice)."""

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

from ster_dist import protocol
from tests.cli_run import cli_generate, make_toy
from tests.held_vector import HeldVector

ray = pytest.importorskip("ray")
pytest.importorskip("ray.job_submission")

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_is_a_valid_ray_cluster_launcher_config():
    import jsonschema
    import ray.autoscaler
    import yaml

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert config["head_node_type"] == "head" and {"gpu_4x", "gpu_8x"} <= set(types)
    # GPUs only on demand
    assert all(types[name]["min_workers"] == 0 for name in ("gpu_4x", "gpu_8x"))
    assert any("HF_HOME" in command for command in config["setup_commands"])
    assert any("STER_STATE_DIR" in command for command in config["head_start_ray_commands"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pids_under(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node of our own: its own ports and temp dir, so other clusters on this machine are
    untouched; stopped by signalling only the processes it started (never `ray stop`)."""
    temp = Path(f"/tmp/rj{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
    state = tmp_path_factory.mktemp("scheduler-state")
    gcs, dashboard = _free_port(), _free_port()
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "STER_STATE_DIR": str(state),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(gcs),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dashboard),
            "--include-dashboard",
            "true",
            "--ray-client-server-port",
            str(_free_port()),
            "--dashboard-agent-listen-port",
            str(_free_port()),
            "--metrics-export-port",
            str(_free_port()),
            "--num-cpus",
            "4",
            "--temp-dir",
            str(temp),
            "--disable-usage-stats",
            "--object-store-memory",
            str(200 * 1024 * 1024),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{dashboard}"
    try:
        from ster_dist.jobqueue.submit import server_answers

        deadline = time.monotonic() + 90
        while not server_answers(url, timeout=2.0):
            if time.monotonic() > deadline or head.poll() is not None:
                raise RuntimeError("the test's Ray head did not come up")
            time.sleep(0.5)
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps a 127.0.0.1 address from being swapped for this
        # machine's eth0 one, but Ray reads it once at import, which collection has already done
        from ray._private import ray_constants

        loopback = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        ray.init(address=f"127.0.0.1:{gcs}", log_to_driver=False, configure_logging=False)
        yield {"url": url, "gcs": f"127.0.0.1:{gcs}", "env": env, "state": state}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if "loopback" in locals():
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = loopback
        for key, value in locals().get("old", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        # Ray's own processes of this cluster, found by our temp dir
        for pid in _pids_under(str(temp)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def records_in(stdout: str) -> list[dict]:
    """The result record(s) jobs/run.py printed, among Ray's own log lines."""
    for line in reversed(stdout.splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and ("jobs" in data or "status" in data):
            return data["jobs"] if "jobs" in data else [data]
    raise AssertionError(f"no result record in:\n{stdout[-3000:]}")


def ray_job_submit(cluster, spec_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "ray"),
            "job",
            "submit",
            "--address",
            cluster["url"],
            "--working-dir",
            ".",
            "--",
            "python",
            "jobs/run.py",
            str(spec_file),
        ],
        cwd=ROOT,
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ray_job_submit_of_generate_jobs_writes_their_results(cluster, toy, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["first question", "second question"]}))
    answers = tmp_path / "out" / "answers.json"
    spec_file = tmp_path / "generate.yaml"
    spec_file.write_text(
        f"jobs:\n"
        f"  - {{kind: generate, model: {toy}, prompt: the capital of France, max_new_tokens: 6}}\n"
        f"  - {{kind: generate, model: {toy}, prompts: {prompts}, output: {answers},"
        f" max_new_tokens: 6}}\n"
    )
    proc = ray_job_submit(cluster, spec_file)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single, many = records_in(proc.stdout)
    assert single["status"] == many["status"] == "done"
    assert single["result"] == cli_generate(
        f"--model={toy}", "--prompt=the capital of France", "--max-new-tokens=6"
    )
    reference = tmp_path / "reference.json"
    cli_generate(
        f"--model={toy}", f"--prompts={prompts}", f"--output={reference}", "--max-new-tokens=6"
    )
    assert json.loads(answers.read_text()) == json.loads(reference.read_text())
    # each job its own; they share the engine
    assert many["result"]["output"] == str(answers) and many["batch"] == 1


def _peft_adapter(base: Path, out: Path):
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(target_modules=["q_proj", "v_proj", "down_proj"], r=4, lora_alpha=8)
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(out)
    return {
        k: v.detach().clone() for k, v in peft_model.eval().merge_and_unload().state_dict().items()
    }


def test_ray_job_submit_of_merge_jobs_writes_the_merged_checkpoints(cluster, tmp_path):
    if "merge" not in protocol.available_kinds() or not (ROOT / "jobs" / "merge.py").is_file():
        pytest.skip("`ster merge` or jobs/merge.py is not in this build yet")
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from tests.tiny_models import make_tiny

    make_tiny("llama", tmp_path / "base")
    expected = _peft_adapter(tmp_path / "base", tmp_path / "adapter")
    single, batch = tmp_path / "merged-single", tmp_path / "merged-batch"
    spec_file = tmp_path / "merge.json"
    spec_file.write_text(
        json.dumps(
            [
                {
                    "kind": "merge",
                    "model": str(tmp_path / "base"),
                    "adapter": str(tmp_path / "adapter"),
                    "output": str(single),
                },
                {
                    "kind": "merge",
                    "merges": [
                        {
                            "model": str(tmp_path / "base"),
                            "adapter": str(tmp_path / "adapter"),
                            "output": str(batch),
                        }
                    ],
                },
            ]
        )
    )
    proc = ray_job_submit(cluster, spec_file)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["status"] for r in records_in(proc.stdout)] == ["done", "done"]
    for directory in (single, batch):
        merged = {}
        for path in sorted(directory.glob("*.safetensors")):
            merged.update(load_file(path))
        for name in (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.2.mlp.down_proj.weight",
        ):
            ref = expected[name]
            assert ((merged[name] - ref).abs().max() / ref.abs().max()).item() < 1e-5, (
                directory,
                name,
            )


def test_ster_submit_wraps_ray_job_submission(cluster, toy, tmp_path):
    # a model under a relative path, as the README's models/smollm2: resolved on the submitting
    # machine
    # (Ray's upload of the working directory leaves git-ignored models/ out); the nodes' Python is
    # this
    # one's, not whatever `python` their PATH finds
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "toy").symlink_to(toy)
    spec_file = tmp_path / "one.json"
    spec_file.write_text(
        json.dumps(
            {"kind": "generate", "model": "models/toy", "prompt": "hello", "max_new_tokens": 4}
        )
    )
    env = {**cluster["env"], "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ster_dist.cli",
            "submit",
            str(spec_file),
            "--address",
            cluster["url"],
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    assert record["status"] == "done" and record["result"]["model"] == str(Path(toy).resolve())
    assert record["result"] == cli_generate(
        f"--model={toy}", "--prompt=hello", "--max-new-tokens=4"
    )
    events = [json.loads(line) for line in proc.stderr.splitlines()]  # NDJSON only
    assert any(e.get("message", "").startswith("generating for 1 prompt") for e in events)
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"kind": "generate", "model": toy, "prompt": "x", "temperature": 0.5})
    )
    refused = subprocess.run(
        [sys.executable, "-m", "ster_dist.cli", "submit", str(bad), "--address", cluster["url"]],
        cwd=ROOT,
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "'seed'" in refused.stderr and refused.stdout == ""


def test_the_python_api_with_an_address_uses_the_clusters_scheduler(cluster, toy):
    from ster_dist.api import Engine

    with Engine(toy, address=cluster["gcs"]) as engine:
        answers = engine.generate(["api one", "api two"], max_new_tokens=4)
        assert engine.stats()["jobs"].get("done", 0) >= 2 and engine.stats()["pid"] != os.getpid()
    assert answers[1] == cli_generate(f"--model={toy}", "--prompt=api two", "--max-new-tokens=4")


def _client(cluster):
    from ster_dist.jobqueue.client import RayClient

    return RayClient(cluster["gcs"])


WORKER_DIED = "a worker died: rank 0 died during "


def _until(poll, message: str, timeout: float = 120.0) -> list[dict]:
    """A job's events up to the first that starts with message (poll: (cursor, timeout) ->
    reply)."""
    seen, cursor, deadline = [], 0, time.monotonic() + timeout
    while not any(e.get("message", "").startswith(message) for e in seen):
        assert time.monotonic() < deadline, [e.get("message") for e in seen]
        reply = poll(cursor, 1.0)
        assert reply["result"] is None, reply["result"]
        seen += reply["events"]
        cursor = reply["cursor"]
    return seen


def _kill_and_wait(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _worker_pid(stats: dict, toy: str) -> int:
    return [g for g in stats["groups"] if g["model"] == toy][0]["workers"][0]["pid"]


def test_a_worker_killed_mid_job_is_restarted_and_the_job_completes(cluster, toy, tmp_path):
    from ster_dist.jobqueue.follow import follow

    client = _client(cluster)
    held = HeldVector(tmp_path, toy)
    (job_id,) = client.submit_many([held.job(toy, "a held answer")])
    finished = lambda: client.poll_many({job_id: 0})[job_id]["result"]  # noqa: E731
    fd = held.wait_for_reader(finished)  # attempt 1 holds its group
    starts = client.stats()["group_starts"]
    killed = _worker_pid(client.stats(), toy)
    _kill_and_wait(killed)  # the rank actor's process, mid-job
    held.release(fd)
    seen = _until(
        lambda cursor, timeout: client.poll_many({job_id: cursor}, timeout)[job_id], WORKER_DIED
    )
    held.release(held.wait_for_reader(finished))  # attempt 2, on a restarted group
    (record,) = follow(client, [job_id], on_event=seen.append, timeout=180)
    assert record["status"] == "done" and record["attempts"] == 2, (
        record["error"],
        [e.get("message") for e in seen],
    )
    stats = client.stats()
    assert stats["group_starts"] == starts + 1 and _worker_pid(stats, toy) != killed
    reference = cli_generate(
        f"--model={toy}", "--prompt=a held answer", "--max-new-tokens=12", "--chat-template=off"
    )
    assert (
        record["result"]["text"] == reference["text"]
        and record["result"]["steering"]["strength"] == 1.0
    )


def test_a_job_whose_worker_keeps_dying_fails_with_the_workers_error_after_its_retries(
    cluster, toy, tmp_path
):
    from ster_dist.jobqueue.queue import JobQueue

    held = HeldVector(tmp_path, toy)
    killed: list[int] = []
    # a scheduler in this process on the cluster: its groups are Ray actors, as in the scheduler
    # actor
    with JobQueue(None, address=cluster["gcs"], max_retries=1) as scheduler:
        job_id = scheduler.submit(held.job(toy, "doomed"))
        for _attempt in range(2):
            fd = held.wait_for_reader(lambda: scheduler.poll(job_id)["result"])
            killed.append(_worker_pid(scheduler.stats(), toy))
            _kill_and_wait(killed[-1])
            held.release(fd)
            if not killed[1:]:  # the retry opens the pipe anew once the first attempt has failed
                _until(lambda cursor, timeout: scheduler.poll(job_id, cursor, timeout), WORKER_DIED)
        record = scheduler.wait(job_id, 120)
        starts = scheduler.stats()["group_starts"]
    assert len(set(killed)) == 2 and starts == 2
    assert record["status"] == "failed" and record["attempts"] == 2 and record["exit_code"] == 2
    assert (
        record["error"].startswith("rank 0 died during ModelRunner.register_vector: ")
        and "gave up after 2 attempts" in record["error"]
    )


def test_the_job_queue_actor_killed_and_restarted_finishes_every_accepted_job_once(cluster, toy):
    from ster_dist.jobqueue.follow import follow

    client = _client(cluster)
    specs = [
        {
            "kind": "generate",
            "model": toy,
            "prompt": f"job {i}",
            "max_new_tokens": 48 + 60 * i,
            "ignore_eos": True,
            "chat_template": "off",
            "id": f"restart-{i}",
        }
        for i in range(5)
    ]
    ids = client.submit_many(specs)
    pid = client.pid()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        replies = client.poll_many({i: 0 for i in ids}, 0.5)
        done = [i for i, r in replies.items() if r["result"] is not None]
        if done:
            break
    assert 1 <= len(done) < len(ids)
    os.kill(pid, signal.SIGKILL)
    records = follow(client, ids, timeout=240)  # calls wait for Ray to restart the actor
    assert client.pid() != pid
    assert [r["status"] for r in records] == ["done"] * 5
    from ster_dist.jobqueue.journal import records as journal_records

    finished = [
        r["id"]
        for r in journal_records((cluster["state"] / "journal.msgpack").read_bytes())
        if r["op"] == "finished"
    ]
    assert sorted(i for i in finished if i.startswith("restart-")) == sorted(ids)  # each once
    for i in (0, 4):
        assert records[i]["result"] == cli_generate(
            f"--model={toy}",
            f"--prompt=job {i}",
            f"--max-new-tokens={48 + 60 * i}",
            "--ignore-eos",
            "--chat-template=off",
        )


def test_ster_queue_status_and_stop(cluster):
    from ster_dist.jobqueue.actor import existing

    def ster(*argv):
        return subprocess.run(
            [sys.executable, "-m", "ster_dist.cli", "queue", *argv, "--address", cluster["gcs"]],
            cwd=ROOT,
            env=cluster["env"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    status = ster("status")
    assert status.returncode == 0, status.stderr[-2000:]
    report = json.loads(status.stdout)
    assert report["jobs"].get("done", 0) >= 5 and report["groups"]
    stopped = ster("stop")
    assert stopped.returncode == 0 and json.loads(stopped.stdout) == {"stopped": True}
    assert existing() is None
    again = ster("status")
    assert again.returncode == 2 and "no ster job queue runs on this cluster" in again.stderr
