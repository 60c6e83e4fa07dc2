"""A named pipe standing in for a generate job's --vector file, so a test can hold a job
mid-attempt.

The pipe is held open for writing from the start (a pipe no process writes to is refused,
inputs.py), and the job is known to be inside it when a second open of it appears in /proc (its
reader)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


class HeldVector:
    """A named pipe standing in for a generate job's --vector file. The command reads it after its
    worker group was handed out, so opening the pipe for writing returns exactly when the job is
    inside its attempt (mid-job, with its group), and the job waits there until the test writes:
    a kill lands mid-job every time, however fast the machine. The vector is zero, so the answer
    is the unsteered one."""

    def __init__(self, directory: Path, toy: str):
        from ster_dist.steer.artifact import Direction, SteeringArtifact

        self.path = directory / "held-vector.json"
        os.mkfifo(self.path)
        self.fd = None
        self._writer()
        hidden = json.loads((Path(toy) / "config.json").read_text())["hidden_size"]
        artifact = SteeringArtifact(
            model=toy,
            model_revision=None,
            trait_name="held",
            method="caa",
            hidden_size=hidden,
            vectors=[Direction(0, torch.zeros(hidden), 1.0, 0.0)],
        )
        self.text = json.dumps(artifact.to_json())

    def _writer(self) -> None:
        """A writer from before a job starts, so its read waits for the text instead of being
        refused (opened again for the next job once wait_for_reader handed the last one's out)."""
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)

    def job(self, toy: str, prompt: str) -> dict:
        self._writer()
        return {
            "kind": "generate",
            "model": toy,
            "prompt": prompt,
            "max_new_tokens": 12,
            "chat_template": "off",
            "vector": str(self.path),
            "strength": 1.0,
        }

    def flags(self) -> list[str]:
        self._writer()
        return ["--vector", str(self.path), "--strength", "1"]

    def _opened(self) -> int:
        """How many open file descriptors of any process on this machine name the pipe (ours is
        one)."""
        count = 0
        for fd_dir in Path("/proc").glob("[0-9]*/fd"):
            try:
                for entry in fd_dir.iterdir():
                    try:
                        count += os.readlink(entry) == str(self.path)
                    except OSError:
                        pass
            except OSError:  # a process that ended, or one we may not look into
                pass
        return count

    def wait_for_reader(self, finished=None, timeout: float = 180.0) -> int:
        """Block until the job opens the pipe; the open write end. finished() -> the job's result
        record once it has one (a job that ended without reading the pipe fails the test at
        once)."""
        deadline = time.monotonic() + timeout
        while self._opened() < 2:
            record = finished() if finished is not None else None
            assert record is None, f"the job ended before reading its --vector file: {record}"
            assert time.monotonic() < deadline, "the job never reached its --vector file"
            time.sleep(0.05)
        # the caller's now: released (or closed, which ends the job's wait empty)
        fd, self.fd = self.fd, None
        return fd

    def release(self, fd: int) -> None:
        """Send the vector and close; then, once the job has read it to the end, hold a writer again
        for the job's next attempt (a retry reads the pipe anew)."""
        os.set_blocking(fd, True)
        os.write(fd, self.text.encode())
        os.close(fd)
        deadline = time.monotonic() + 60
        while self._opened() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self._writer()
