"""Outputs that appear whole or not at all: write beside the target, then rename.

Every file and directory ster_dist writes goes through here, so a reader (or a rerun after a
crash) never sees half an output, and every output gets the same permissions: those the process
umask gives a new file (mkstemp alone would leave 0600 on some outputs and not others).

A temporary is named `.NAME.partial-PID@HOST-RANDOM`: a writer killed outright (SIGKILL, power
loss) cannot remove it, so the next writer of the same NAME removes the partials whose writer is
gone (`sweep_stale`), and never one whose writer still runs. A write that fails for want of space
(or a size limit, a quota, a read-only filesystem) ends in one Refusal line (`refusing_full_disk`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

from ster_dist.errors import Refusal

# A dead writer's partial is removed once untouched this long: a pid seen dead in another pid
# namespace sharing the host name (a container) may still be writing, and then it touches its files.
STALE_AFTER_S = 120
# A partial written from another host (a shared filesystem): its pid cannot be checked from here.
STALE_FOREIGN_AFTER_S = 24 * 3600
_PARTIAL = re.compile(r"\.partial-(?P<pid>\d+)@(?P<host>[A-Za-z0-9_.]+)-[a-z0-9_]+")

# errno -> what ran out, for the refusal line
SPACE_ERRORS = {
    errno.ENOSPC: "no space left",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "a file size limit was reached",
    errno.EROFS: "the filesystem is read-only",
}


def _umask() -> int:
    # os.umask can only be read by setting it; set it straight back
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fix_mode(path: Path, directory: bool) -> None:
    """The umask's mode on a file, or on a directory and everything in it (writers such as
    safetensors' save_file create their files 0600 whatever the umask)."""
    mask = _umask()
    os.chmod(path, (0o777 if directory else 0o666) & ~mask)
    if not directory:
        return
    for root, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            file = os.path.join(root, name)
            # a link, or a hard link to a file outside (an imported .gguf) keeps its owner's mode
            if not os.path.islink(file) and os.stat(file).st_nlink == 1:
                os.chmod(file, 0o666 & ~mask)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def partial_prefix(path) -> str:
    """The temporary-name prefix for a partial of `path`: it names this process and host."""
    return f".{Path(path).name}.partial-{os.getpid()}@{_host()}-"


def _writer_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _last_touched(path: Path) -> float:
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def sweep_stale(path) -> list[Path]:
    """Remove the partials of `path` left by writers that are gone; returns what was removed."""
    path = Path(path)
    prefix = f".{path.name}.partial-"
    removed = []
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix)]
    except OSError:
        return removed
    host, now = _host(), time.time()
    for name in names:
        match = _PARTIAL.fullmatch(name[len(path.name) + 1 :])
        if match is None:
            continue
        candidate = path.parent / name
        try:
            idle = now - _last_touched(candidate)
        except OSError:
            continue
        if match["host"] == host:
            stale = not _writer_alive(int(match["pid"])) and idle >= STALE_AFTER_S
        else:
            stale = idle >= STALE_FOREIGN_AFTER_S
        if stale:
            if candidate.is_dir() and not candidate.is_symlink():
                shutil.rmtree(candidate, ignore_errors=True)
            else:
                candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def space_refusal(exc: OSError, output, needed: int | None = None) -> Refusal | None:
    """The one-line refusal for a write that failed for want of space, or None for other errors."""
    what = SPACE_ERRORS.get(getattr(exc, "errno", None))
    if what is None:
        return None
    size = f" ({needed} bytes needed)" if needed else ""
    fix = (
        "choose another --output"
        if exc.errno == errno.EROFS
        else "free space (or raise the limit) or choose another --output"
    )
    return Refusal(f"{what} writing {output}{size}; nothing was kept: {fix}")


@contextlib.contextmanager
def refusing_full_disk(output, needed: int | None = None, cleanup=()):
    """Turn a write failing for want of space inside the block into space_refusal's line, after
    removing `cleanup` (work directories the block would otherwise leave behind)."""
    try:
        yield
    except OSError as exc:
        refusal = space_refusal(exc, output, needed)
        if refusal is None:
            raise
        for leftover in cleanup:
            leftover = Path(leftover)
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        raise refusal from None


@contextlib.contextmanager
def replacing(path, binary: bool = False, durable: bool = False):
    """A handle on a temporary file beside `path`; renamed onto `path` when the block ends without
    an error, removed otherwise. `durable`: fsync before the rename (a journal)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path)
    fd, tmp = tempfile.mkstemp(prefix=partial_prefix(path), dir=path.parent)
    try:
        with os.fdopen(
            fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})
        ) as handle:
            yield handle
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        _fix_mode(Path(tmp), directory=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path, data) -> None:
    with replacing(path) as handle:
        json.dump(data, handle, indent=2, ensure_ascii=False)


def write_bytes(path, data: bytes, durable: bool = False) -> None:
    with replacing(path, binary=True, durable=durable) as handle:
        handle.write(data)


@contextlib.contextmanager
def staging_dir(path, replace: bool = False):
    """A temporary directory beside `path` to fill; renamed to `path` when the block ends without
    an error, removed otherwise. `replace`: an existing `path` is swapped out (removed only after
    the new one is in place), else an existing `path` is an error the caller refuses earlier."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path)
    staging = Path(tempfile.mkdtemp(prefix=partial_prefix(path), dir=path.parent))
    try:
        yield staging
        _fix_mode(staging, directory=True)
        if replace and path.exists():
            old = Path(tempfile.mkdtemp(prefix=partial_prefix(path), dir=path.parent))
            os.replace(path, old / "previous")
            os.replace(staging, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def finish_dir(staging, path) -> None:
    """Rename a filled staging directory onto `path` with the umask's mode (for writers that keep
    their work directory across runs to resume, and so cannot use staging_dir)."""
    staging, path = Path(staging), Path(path)
    _fix_mode(staging, directory=True)
    os.rename(staging, path)
