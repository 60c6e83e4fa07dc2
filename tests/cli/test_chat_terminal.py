"""`ster chat` as a person at a terminal meets it: its progress as one line that updates in place
(no JSON), left standing above the prompt, and its totals in words at the end; JSON events again
with
--events. Run in a pseudo-terminal (python's pty module), against a toy model. The stream that draws
the line (events.ProgressLine) is checked on its own too."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest

from ster_dist.events import ProgressLine
from tests.cli_run import make_toy

ROOT = Path(__file__).resolve().parents[2]


def test_progress_line_rewrites_one_line_cut_to_the_width_and_ends_it_once():
    shown = io.StringIO()
    line = ProgressLine(shown, width=30)
    line.write(json.dumps({"event": "progress", "message": "loading"}) + "\n")
    line.write("a library's own notice, long enough to be cut at the width\n")
    # no newline yet: held
    line.write(json.dumps({"event": "progress", "message": "ready"}) + "\npartial")
    line.end_line()
    line.end_line()  # nothing more to end
    assert shown.getvalue() == (
        "\r\x1b[Kloading" + "\r\x1b[Ka library's own notice, lo..." + "\r\x1b[Kready" + "\n"
    )


def _converse(argv: list[str], turns: list[str], timeout: float = 240) -> str:
    """Everything the terminal showed while `turns` were typed, one after each prompt."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: ster chat with the pseudo-terminal as its stdin, stdout and stderr
        os.environ["PYTHONPATH"] = str(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "ster_dist.cli", "chat", *argv])
    shown, pending, deadline = b"", list(turns), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child ended: the terminal is closed
                break
            if not chunk:
                break
            shown += chunk
            if pending and shown.count(b"> ") > len(turns) - len(pending):
                os.write(fd, (pending.pop(0) + "\n").encode())
        else:
            raise AssertionError(
                f"ster chat did not finish; the terminal showed: {shown[-2000:]!r}"
            )
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, shown[-2000:]
    return shown.decode("utf-8", "replace")


# a fresh interpreter loads torch and the model twice: about a minute on two busy cores
@pytest.mark.slow
def test_chat_at_a_terminal_reads_as_a_person_would_and_gives_json_with_events(tmp_path_factory):
    toy = make_toy(tmp_path_factory)
    shown = _converse([f"--model={toy}", "--max-new-tokens=4"], ["hello", "/exit"])
    before, _, after = shown.partition("> ")
    assert '{"event"' not in shown  # no JSON anywhere
    # several progress messages, each drawn over the one before
    assert before.count("\r\x1b[K") >= 2
    # on one line, left standing above the prompt
    assert before.count("\n") == 1 and before.endswith("\n")
    assert "chatting with" in before.rsplit("\r\x1b[K", 1)[1]  # the last message: how to chat
    assert re.search(r"1 turn: \d+ prompt tokens read, \d+ tokens answered\r?\n$", after), after[
        -300:
    ]

    shown = _converse([f"--model={toy}", "--max-new-tokens=4", "--events"], ["hello", "/exit"])
    lines = [line for line in shown.replace("\r", "").split("\n") if line.startswith("{")]
    assert any(json.loads(line).get("event") == "progress" for line in lines)
    assert json.loads(lines[-1]) == {
        "turns": 1,
        **{k: json.loads(lines[-1])[k] for k in ("prompt_tokens", "completion_tokens")},
    }
