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
