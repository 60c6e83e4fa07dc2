"""Input files (inputs.read_bytes / read_text, issue 60): only regular files are read, and their
size is counted as they are read, not taken from st_size, so a device, a FIFO or a file past the
bound is a one-line refusal in bounded time and memory."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc

import pytest

from ster_dist import inputs
from ster_dist.errors import Refusal
from ster_dist.steer.artifact import load_artifact
from ster_dist.steer.pairs import load_pairs


def test_a_device_is_refused_at_once_without_reading_it():
    tracemalloc.start()
    started = time.monotonic()
    with pytest.raises(Refusal, match="--system /dev/zero is not a regular file"):
        inputs.read_text("/dev/zero", "--system")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.monotonic() - started < 1.0 and peak < 1 << 20


def test_a_fifo_without_a_writer_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    box = []
    reader = threading.Thread(
        target=lambda: box.append(_refusal(inputs.read_text, str(fifo), "--prompts")), daemon=True
    )
    reader.start()
    reader.join(5)
    assert box == [f"--prompts {fifo} is a pipe no process writes to; name a file"]


def test_a_fifo_a_process_writes_is_read_within_the_bound(tmp_path):
    """A pipe with a writer (a shell's `<(...)`) is read as it comes, and counted as it is read."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    # held open: the reader sees a writer, then waits
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    box = []
    reader = threading.Thread(
        target=lambda: box.append(inputs.read_text(str(fifo), "--system")), daemon=True
    )
    reader.start()
    time.sleep(0.2)
    assert reader.is_alive() and box == []  # waiting for what the writer sends
    os.set_blocking(writer, True)
    os.write(writer, b"be brief")
    os.close(writer)
    reader.join(5)
    assert box == ["be brief"]
    endless = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    # more than the bound, the writer still open: refused by what was read
    os.write(endless, b"x" * 2000)
    with pytest.raises(Refusal, match=r"is more than the 1000 bytes an input file may hold"):
        inputs.read_text(str(fifo), "--system", limit=1000)
    os.close(endless)


def test_a_file_past_the_bound_is_refused_by_what_is_read(tmp_path, monkeypatch):
    big = tmp_path / "big.txt"
    big.write_text("x" * 1001)
    assert inputs.read_text(str(big), "--system", limit=1001) == "x" * 1001
    with pytest.raises(Refusal, match=r"is more than the 1000 bytes an input file may hold"):
        inputs.read_text(str(big), "--system", limit=1000)


def test_a_directory_and_a_missing_file_are_one_line(tmp_path):
    assert (
        _refusal(inputs.read_text, str(tmp_path), "--system")
        == f"--system {tmp_path} is a directory; name a file"
    )
    assert (
        _refusal(inputs.read_text, str(tmp_path / "no"), "--system")
        == f"--system {tmp_path / 'no'}: No such file or directory"
    )


@pytest.mark.parametrize(
    "reader", [load_artifact, load_pairs], ids=["steering-artifact", "pair-set"]
)
def test_the_steering_readers_refuse_a_device_too(reader):
    with pytest.raises(Refusal, match="/dev/zero is not a regular file"):
        reader("/dev/zero")


def _refusal(fn, *args) -> str:
    try:
        fn(*args)
    except Refusal as refusal:
        return str(refusal)
    return "no refusal"


@pytest.mark.parametrize(
    "reader", [load_artifact, load_pairs], ids=["steering-artifact", "pair-set"]
)
def test_the_steering_readers_refuse_json_nested_too_deep(reader, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(Refusal, match="nest too deeply; flatten it"):
        reader(str(deep))
