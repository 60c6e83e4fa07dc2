"""Outputs that appear whole or not at all: write beside the target, then rename.

Every file and directory ster_dist writes goes through here, so a reader (or a rerun after a
crash) never sees half an output, and every output gets the same permissions: those the process
umask gives a new file (mkstemp alone would leave 0600 on some outputs and not others).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path


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


@contextlib.contextmanager
def replacing(path, binary: bool = False, durable: bool = False):
    """A handle on a temporary file beside `path`; renamed onto `path` when the block ends without
    an error, removed otherwise. `durable`: fsync before the rename (a journal)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
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
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield staging
        _fix_mode(staging, directory=True)
        if replace and path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
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
