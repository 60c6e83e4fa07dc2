"""Progress events: one JSON object per line on stderr, what every operation reports as it goes.

The job queue routes a running job's lines into that job's event log (jobqueue/events.py), so a
caller polling the queue, in this process or through the Ray actor, sees what the command line would
show.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import threading
import time


def progress(message: str, **fields) -> None:
    print(
        json.dumps(
            {"event": "progress", "time": round(time.time(), 3), "message": message, **fields},
            ensure_ascii=False,
        ),
        file=sys.stderr,
        flush=True,
    )


def text_delta(text: str) -> None:
    """A piece of generated text as it comes (`generate --stream`): the command line prints it on
    stdout."""
    print(
        json.dumps(
            {"event": "text", "time": round(time.time(), 3), "text": text}, ensure_ascii=False
        ),
        file=sys.stderr,
        flush=True,
    )


def as_event(line: str) -> dict:
    """A line of stderr as an event: itself when it is one, else a log event carrying it."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        event = {"event": "log", "time": round(time.time(), 3), "message": line}
    return event


class StreamWrapper(io.TextIOBase):
    """A text stream standing in for stderr that hands its lines on to `original`."""

    def __init__(self, original):
        self.original = original

    def flush(self) -> None:
        self.original.flush()

    def fileno(self) -> int:
        return self.original.fileno()

    @property
    def encoding(self):
        return getattr(self.original, "encoding", "utf-8")

    def isatty(self) -> bool:
        return False


class JsonLines(StreamWrapper):
    """A stderr that keeps the promise of one JSON object per line: a line that is one passes
    through, any other text a library prints (Ray's notices, a warning) becomes a log event, and a
    carriage return ends a line too, so a progress bar cannot smear the stream."""

    def __init__(self, original):
        super().__init__(original)
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).replace("\r", "\n").split("\n")
            for line in lines:
                if line.strip():
                    self.original.write(_as_json_line(line) + "\n")
        return len(text)


def _as_json_line(line: str) -> str:
    stripped = line.strip()
    if stripped.startswith("{"):
        try:
            if isinstance(json.loads(stripped), dict):
                return stripped
        except ValueError:
            pass
    return json.dumps(
        {"event": "log", "time": round(time.time(), 3), "message": stripped}, ensure_ascii=False
    )


@contextlib.contextmanager
def json_stderr():
    """sys.stderr as JsonLines for the block (the command line's progress stream); progress bars of
    the Hub client and Transformers are turned off, since they redraw one line many times."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    original, sys.stderr = sys.stderr, JsonLines(sys.stderr)
    try:
        yield original
    finally:
        sys.stderr.flush()
        sys.stderr = original


class ProgressLine(StreamWrapper):
    """A stderr for a person at a terminal (`ster chat`): each progress event's message, or any
    other line a library prints, replaces the one before on a single line cut to the terminal's
    width, and `end_line()` (or the end of the block) leaves the last one standing before other
    output."""

    def __init__(self, original, width: int = 80):
        super().__init__(original)
        self.width = max(20, width)
        self._partial = ""
        self._shown = False
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).replace("\r", "\n").split("\n")
            for line in lines:
                if line.strip():
                    message = " ".join(str(_message_of(line)).split())
                    cut = (
                        message if len(message) < self.width else message[: self.width - 4] + "..."
                    )
                    # back to the line's start, the line cleared, the message written over it
                    self.original.write("\r\x1b[K" + cut)
                    self._shown = True
            self.original.flush()
        return len(text)

    def end_line(self) -> None:
        with self._lock:
            if self._shown:
                self.original.write("\n")
                self.original.flush()
                self._shown = False


def _message_of(line: str) -> str:
    event = as_event(line.strip())
    return event.get("message") or event.get("text") or line.strip()


def end_progress_line() -> None:
    """Leave a person's progress line standing before other output (a prompt); with JSON events,
    nothing."""
    end = getattr(sys.stderr, "end_line", None)
    if end is not None:
        end()


@contextlib.contextmanager
def progress_line():
    """sys.stderr as a ProgressLine as wide as its terminal for the block, with the same progress
    bars turned off as json_stderr."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        width = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        width = 80
    original, sys.stderr = sys.stderr, ProgressLine(sys.stderr, width)
    try:
        yield original
    finally:
        sys.stderr.flush()
        sys.stderr.end_line()
        sys.stderr = original
