"""The Ray path as a newcomer meets it (issue 59), the parts that need no cluster: a job server
that answers 401 (Ray's token authentication) is named as such with how to give the token, not
reported absent; a relative model path that Ray's upload left out (git-ignored models/) is refused
inside the Ray job with a line saying so, not read as a Hub id; `ster submit --local` and
`jobs/run.py --local` print the same record."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ster_dist.cli import main
from ster_dist.jobqueue.entry import run_jobs
from ster_dist.schema.jobs import RunJobsRequest
from tests.cli_run import make_toy

ROOT = Path(__file__).resolve().parents[2]


class _Locked(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        _Locked.seen.append(self.headers.get("Authorization"))
        self.send_response(401)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def locked_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Locked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("token", [None, "not-the-clusters"])
def test_a_401_from_the_job_server_says_a_ray_auth_token_is_needed(
    locked_server, tmp_path, capsys, monkeypatch, token
):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token of this machine's
    if token is not None:
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    else:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"kind": "generate", "model": "some/model", "prompt": "hi"}))
    _Locked.seen.clear()
    assert main(["submit", str(spec), "--address", locked_server]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"the Ray job server at {locked_server} answered 401" in err and "RAY_AUTH_TOKEN" in err
    assert ("was refused" if token else "was not given") in err
    assert "no Ray job server answers" not in err
    # Ray's header sent when a token is set
    assert (_Locked.seen[-1] is not None) == (token is not None)


def test_a_relative_model_left_out_of_the_upload_is_refused_in_the_ray_job(
    tmp_path, monkeypatch, capsys
):
    # as Ray unpacks the working directory: .gitignore'd paths gone
    uploaded = tmp_path / "working_dir_files"
    uploaded.mkdir()
    (uploaded / ".gitignore").write_text("# local checkpoints\n/models/\n*.pyc\n")
    spec = uploaded / "job.json"
    spec.write_text(
        json.dumps(
            {"kind": "generate", "model": "models/smollm2", "prompt": "hi", "id": "newcomer"}
        )
    )
    monkeypatch.chdir(uploaded)
    assert run_jobs(RunJobsRequest(specs=[str(spec)], local=True)) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0
        and "job newcomer: model 'models/smollm2' is not inside the uploaded" in err
    )
    assert "ster submit" in err and "absolute path" in err


@pytest.mark.slow  # two whole processes: about 50 s on 2 cores
def test_submit_local_and_jobs_run_local_print_the_same_record(tmp_path_factory, tmp_path):
    toy = make_toy(tmp_path_factory)
    spec = tmp_path / "job.json"
    spec.write_text(
        json.dumps(
            {"kind": "generate", "model": toy, "prompt": "same", "max_new_tokens": 3, "id": "same"}
        )
    )
    outs = []
    for argv in (
        ["-m", "ster_dist.cli", "submit", str(spec), "--local"],
        ["jobs/run.py", str(spec), "--local"],
    ):
        done = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(json.loads(done.stdout))
    assert outs[0] == outs[1] and outs[0]["status"] == "done"
