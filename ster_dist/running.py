"""What an operation knows of the job it runs for: the job's id (the prefix of its token-engine
request ids, so that jobs sharing one engine never reuse an id) and whether it was cancelled.

The job queue runs each job's operation on a thread of its own inside `job_scope(context)`;
operations read `current()` (outside a job: an anonymous context that is never cancelled). A
long operation checks `context.check()` between steps and registers `on_cancel` callbacks for
work that must stop at once (a token-engine request, whose cancellation frees its KV blocks at
the engine's next step).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from ster_dist.errors import Refusal


class Cancelled(Refusal):
    """The job was cancelled (`ster queue cancel`, Ctrl-C or SIGTERM on `ster submit --local`)."""

    exit_code = 130


class JobContext:
    def __init__(self, job_id: str | None = None):
        self.job_id = job_id
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self.reason is not None

    def cancel(self, reason: str = "cancelled") -> bool:
        """Cancel once (False when already cancelled); the callbacks run here, on the caller's
        thread."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
        return True

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run callback at cancellation (now, when already cancelled); returns what unregisters
        it."""
        with self._lock:
            if self.reason is None:
                self._callbacks.append(callback)
                return lambda: self._forget(callback)
        callback()
        return lambda: None

    def check(self) -> None:
        """Raise Cancelled when the job was cancelled: an operation's way to stop between steps."""
        if self.reason is not None:
            raise Cancelled(f"job {self.job_id} was cancelled: {self.reason}")

    def request_id(self, index: int) -> str | None:
        """The id of the job's index-th engine request (None outside a job: the engine numbers
        it)."""
        return None if self.job_id is None else f"{self.job_id}#{index}"

    def _forget(self, callback) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._callbacks.remove(callback)


_LOCAL = threading.local()


def current() -> JobContext:
    """The context of the job this thread runs (an anonymous one outside any job)."""
    context = getattr(_LOCAL, "context", None)
    return context if context is not None else JobContext()


@contextlib.contextmanager
def job_scope(context: JobContext):
    """This thread runs the job of `context` inside the block."""
    before = getattr(_LOCAL, "context", None)
    _LOCAL.context = context
    try:
        yield context
    finally:
        _LOCAL.context = before
