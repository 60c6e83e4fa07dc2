"""What Ster's serve API may touch on the server's machine: the paths a body names (files it reads,
files it writes) and the model it runs.

A body's fields are paths on the server, so without a bound a client could read any file into a
prompt (`system: /etc/hostname`), overwrite one (`output`), or load any model directory or Hub id.
A path must lie, once resolved (symlinks and `..` followed), inside the server's working directory
or a directory given as `--allow-path DIR`; a model must be the served one (any spelling of its
directory) or one named by `--allow-models`. Refused as 403, naming the field and the flag that
would allow it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ster_dist.inputs import INPUT_FIELDS

# the request fields that name a file or directory on the server (besides the model): every input
# an operation reads, what it writes, and Ster's inline-or-path artifact
PATH_FIELDS = (*(name for name in INPUT_FIELDS if name != "model"), "output", "artifact")


class Forbidden(Exception):
    """A field names what this server does not let its API touch (a 403)."""


class Confinement:
    def __init__(
        self,
        served_model: str,
        allow_paths: list[str] | None = None,
        allow_models: list[str] | None = None,
        root: str | None = None,
    ):
        self.roots = [_resolved(root or os.getcwd()), *(_resolved(p) for p in allow_paths or ())]
        self.models = [served_model, *(allow_models or ())]

    def check(self, request, label=lambda name: name) -> None:
        """Refuse the first field of `request` outside the allowed paths, or a model not allowed."""
        model = getattr(request, "model", None)
        if isinstance(model, str) and not any(
            _same_model(model, allowed) for allowed in self.models
        ):
            runs = ", ".join(map(repr, self.models))
            raise Forbidden(
                f"{label('model')} {model!r} is not served here: this server runs {runs}; leave the "
                "field out, or start ster serve with --allow-models NAME"
            )
        for name in PATH_FIELDS:
            value = getattr(request, name, None)
            if not isinstance(value, str) or not value or value == "-":
                continue
            if not any(_resolved(value).is_relative_to(root) for root in self.roots):
                raise Forbidden(
                    f"{label(name)} {value} is outside the directories this server lets its API "
                    f"read and write ({', '.join(map(str, self.roots))}); name a path inside one, or "
                    "start ster serve with --allow-path DIR"
                )


def _resolved(path: str) -> Path:
    return Path(path).expanduser().resolve()


def _same_model(given: str, allowed: str) -> bool:
    """The same name, or two spellings of one local directory."""
    if given == allowed:
        return True
    a, b = Path(given).expanduser(), Path(allowed).expanduser()
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()
