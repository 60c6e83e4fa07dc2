"""One attempt of a job, run on a thread of its own that the job queue waits for until the job's
deadline and abandons past it (or sooner: when another attempt's timeout dropped the group it ran
on).

Python cannot stop a thread: a job stuck in a looping chat template or in a call to a rank that
never answers keeps its thread. So the job queue's executor (and each generate lane) never runs an
operation itself: it starts it here, waits up to the deadline, and past it marks the attempt
abandoned and goes on. What the abandoned thread does later is ignored (its callbacks check
`abandoned` under the queue's lock before touching a job), and once it ends at last it runs the
cleanups it was given (closing the session it was using, which the pool already dropped).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Attempt:
    def __init__(self, work: Callable[[Attempt], object], name: str):
        # set under the job queue's lock; read by the thread's callbacks under it
        self.abandoned = False
        # the pooled session the work was handed: the group to drop if abandoned
        self.session = None
        self._work = work
        self._done = threading.Event()
        # the work ended, or the attempt was abandoned: stop waiting
        self._settled = threading.Event()
        self._value = None
        self._error: BaseException | None = None
        self._cleanups: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> Attempt:
        self._thread.start()
        return self

    def wait(self, deadline: float | None) -> bool:
        """True once the work ended (returned or raised); False when the deadline (monotonic) passed
        or the attempt was abandoned first."""
        self._settled.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._done.is_set()

    def abandon(self) -> None:
        """Nothing the thread does from here reaches a job; whoever waits stops waiting. (Under the
        job queue's lock, which the thread's callbacks take before they read `abandoned`.)"""
        self.abandoned = True
        self._settled.set()

    def outcome(self):
        """What the work returned, or its exception raised here (only after wait() said it
        ended)."""
        if self._error is not None:
            raise self._error
        return self._value

    def after_abandoned(self, cleanup: Callable[[], None]) -> None:
        """Run cleanup once the abandoned thread ends (now, when it already has)."""
        with self._lock:
            if not self._done.is_set():
                self._cleanups.append(cleanup)
                return
        _quietly(cleanup)

    def _main(self) -> None:
        try:
            self._value = self._work(self)
        except BaseException as exc:  # every failure is the job's, reported by whoever waits
            self._error = exc
        finally:
            with self._lock:
                self._done.set()
                self._settled.set()
                cleanups, self._cleanups = self._cleanups, []
            for cleanup in cleanups:
                _quietly(cleanup)


def _quietly(cleanup: Callable[[], None]) -> None:
    try:
        cleanup()
    except Exception:  # a late cleanup of an abandoned attempt has nobody to report to
        pass
