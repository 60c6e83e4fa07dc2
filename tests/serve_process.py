"""A `ster serve` process for tests: started as a user starts it, ready when it prints its ready
line, stopped with SIGTERM (and killed if it does not drain in time)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    def __init__(self, *argv, env: dict | None = None, timeout: float = 180.0):
        self.argv = [sys.executable, "-m", "ster_dist.cli", "serve", *map(str, argv)]
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )
        self.stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        line = self._ready(timeout)
        self.ready = json.loads(line)
        self.port = self.ready["port"]
        self.url = f"http://127.0.0.1:{self.port}"

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _ready(self, timeout: float) -> str:
        box: list[str] = []
        reader = threading.Thread(
            target=lambda: box.append(self.proc.stdout.readline()), daemon=True
        )
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            self.proc.kill()
            raise AssertionError(f"ster serve never became ready: {''.join(self.stderr)[-3000:]}")
        return box[0]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def rest_of_stdout(self) -> str:
        return self.proc.stdout.read()


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """One unlabelled sample of the server's /metrics."""
    import httpx

    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_for(check, timeout: float = 30.0, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(step)
