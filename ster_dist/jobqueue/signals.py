"""Ctrl-C and SIGTERM on a command that runs an in-process job queue (`ster submit --local`,
`jobs/run.py --local`): its jobs are cancelled, each at its next step, and the command goes on
to print their records, instead of waiting the jobs out or dying without a word."""

from __future__ import annotations

import contextlib
import signal
import threading

from ster_dist.errors import Refusal
from ster_dist.events import progress


@contextlib.contextmanager
def cancelled_on_signals(queue, ids: list[str]):
    """Ctrl-C or SIGTERM inside the block cancels the jobs (each stops at its next step, journaled
    `cancelled`), and the caller goes on following them to their records; a second Ctrl-C stops at
    once. Only on the main thread (where Python delivers signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(number, frame) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: stop now
        name = signal.Signals(number).name
        progress(f"{name}: cancelling job(s) {', '.join(ids)}")

        def cancel_all() -> None:  # off the signal handler: cancelling takes the queue's lock
            for job_id in ids:
                with contextlib.suppress(Refusal):
                    queue.cancel(job_id, f"{name} on the submitting command")

        threading.Thread(target=cancel_all, name="ster-cancel", daemon=True).start()

    before = {
        number: signal.signal(number, on_signal) for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
