"""Config lookups with aliases: the one way config.py and its helpers read a (normalised) config
dict."""

from __future__ import annotations

from ster_dist.errors import Refusal


class Keys:
    """Config lookups with aliases; unstated (missing or null) keys fall through."""

    def __init__(self, raw: dict, path: str):
        self.raw = raw
        self.path = path

    def get(self, *names: str, default=None):
        for name in names:
            value = self.raw.get(name)
            if value is not None:
                return value
        return default

    def need(self, *names: str):
        value = self.get(*names)
        if value is None:
            raise Refusal(f"invalid model config {self.path}: missing {' / '.join(names)}")
        return value
