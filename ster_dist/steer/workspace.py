"""Ster's workspace: persistent pair sets under `$XDG_DATA_HOME/ster` (or `~/.local/share/ster`),
one of them active (`ster workspace import-pairs | show | select | remove`, `ster onboarding
--import-pairs`); `vector train` and the other pair readers use the active set without --pairs.

An import validates the whole document (steer/pairs.py) before writing anything, then keeps a
canonical copy (`pairs/<id>.json`, the pretty form `pairs add` writes) and makes it active. The id
is the imported file's name without `.json`. The same content again is `unchanged`; the same id
with other content is `conflicting` and never overwrites the first set. `workspace.json` holds the
active id; the sets are the files themselves, so the two cannot disagree about what exists.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ster_dist.atomic import write_json
from ster_dist.errors import Refusal
from ster_dist.steer.pair_files import pair_document, save_pairs
from ster_dist.steer.pairs import load_pairs


def root() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "ster"


def _state_path() -> Path:
    return root() / "workspace.json"


def _set_path(set_id: str) -> Path:
    return root() / "pairs" / f"{set_id}.json"


def _active() -> str | None:
    try:
        active = json.loads(_state_path().read_text()).get("active")
    except (OSError, ValueError, AttributeError):
        return None
    return active if isinstance(active, str) and _set_path(active).is_file() else None


def _set_active(set_id: str | None) -> None:
    write_json(_state_path(), {"active": set_id})


def show() -> dict:
    """`ster workspace show`'s document: every set with its trait and size, and the active one."""
    directory = root() / "pairs"
    sets = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        pairs = load_pairs(str(path))
        sets.append(
            {
                "id": path.stem,
                "trait_name": pairs.trait_name,
                "pair_count": len(pairs.pairs),
                "path": str(path),
            }
        )
    active = _active()
    return {"root": str(root()), "active": active, "sets": sets}


def _check_id(set_id: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", set_id):
        raise Refusal(
            f"pair set id {set_id!r} must be letters, digits, '.', '_' or '-'; rename the file"
        )
    return set_id


def import_pairs(path: str) -> tuple[dict, str]:
    """(show's document, "imported" | "unchanged" | "conflicting")."""
    pairs = load_pairs(path)  # the whole document validated before anything is written
    name = Path(path).name
    set_id = _check_id(name[: -len(".json")] if name.endswith(".json") else name)
    target = _set_path(set_id)
    if target.is_file():
        if pair_document(load_pairs(str(target))) != pair_document(pairs):
            return {**show(), "id": set_id}, "conflicting"
        outcome = "unchanged"
    else:
        save_pairs(str(target), pairs)
        outcome = "imported"
    _set_active(set_id)
    return {**show(), "id": set_id}, outcome


def _known(set_id: str) -> Path:
    path = _set_path(_check_id(set_id))
    if not path.is_file():
        raise Refusal(
            f"no pair set {set_id!r} in the workspace {root()}; `ster workspace show` lists them"
        )
    return path


def select(set_id: str) -> dict:
    _known(set_id)
    _set_active(set_id)
    return show()


def remove(set_id: str) -> dict:
    _known(set_id).unlink()
    if _active() is None:
        _set_active(None)
    return show()


def active_pairs() -> str:
    """The active set's path, for a pair reader given no --pairs."""
    active = _active()
    if active is None:
        raise Refusal(
            "no --pairs given and no active pair set: pass --pairs FILE, or import one with "
            "`ster workspace import-pairs FILE`"
        )
    return str(_set_path(active))
