"""Refusals: bad input named in one line, raised where the fact is known.

The CLI prints a Refusal's message once on stderr and exits non-zero; it never
shows a traceback for one.
"""


class Refusal(Exception):
    """An input ster_dist will not run, with a one-line message naming the problem and the fix."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))

    @property
    def message(self) -> str:
        return str(self)


class InvalidField(Refusal):
    """A refusal of one field of a request, which it names (an API error's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class WorkerLost(Refusal):
    """A worker process of a group died or stopped answering, so the group was shut down: not a
    fault of the input, and a retry on a restarted group may succeed (the job queue does so)."""


class JobFailed(Refusal):
    """A job the job queue ran failed: its error in one line, and the exit status the command line
    gives for it (2 for a refusal, 1 for an error inside ster_dist)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class OutOfMemory(Refusal):
    """A rank (or this process) ran out of memory: reported whole, with Ray's memory line when Ray
    killed it, and an exit status of its own (3), since neither the input nor ster_dist is at fault
    and the fix is more memory or a smaller share per rank."""

    exit_code = 3
