"""Property-based fuzzing of the GGUF reader (issue 19): a .gguf file is untrusted input.

Whatever the bytes (arbitrary, a framed header whose counts, types, lengths and offsets lie, a
real file truncated or with bytes changed), opening it, reading its config, tokenizer and every
tensor, or importing it ends in a value or a one-line Refusal: never another exception, never a
hang (hypothesis' deadline), never an allocation the file's size does not bound (a declared
length of 2**60 is refused before anything is read, not allocated). The default example counts
keep the file fast; the slow-marked run draws ten times more.
"""

from __future__ import annotations

import atexit
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ster_dist.errors import Refusal
from ster_dist.gguf.importer import gguf_config, gguf_tokenizer, import_gguf
from ster_dist.gguf.source import GGUFSource, family_of, open_reader
from tests.gguf_fixtures import write_llama

FAST = settings(
    max_examples=120,
    deadline=3000,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
SLOW = settings(
    max_examples=1500,
    deadline=3000,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
SCRATCH = Path(tempfile.mkdtemp(prefix="ster-fuzz-gguf-"))
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)

# GGUF value types and the struct format of their scalars
SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
STRING, ARRAY = 8, 9
HUGE = st.sampled_from([2**31, 2**32 - 1, 2**32, 2**60, 2**63, 2**64 - 1])
COUNTS = st.integers(min_value=0, max_value=6) | HUGE


def _file(data: bytes, name: str = "fuzz.gguf") -> Path:
    path = SCRATCH / name
    path.write_bytes(data)
    return path


def _open_everything(path: Path) -> None:
    """What every command does with a .gguf: open, derive config and tokenizer, read all tensors."""
    reader = open_reader(path)
    family = family_of(reader, path)
    config = gguf_config(reader, family)
    source = GGUFSource(path, config, reader=reader)
    try:
        for name in source.names():
            source.read(name)
    finally:
        source.close()
    gguf_tokenizer(reader, path)


def _refused_or_read(data: bytes) -> None:
    try:
        _open_everything(_file(data))
    except Refusal as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 2000


# ---- framed headers ------------------------------------------------------------------------------


def _string(text: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text


@st.composite
def values(draw, depth: int = 0):
    """(type, encoded value): a scalar, a string whose declared length may lie, or an array whose
    declared count and item type may lie."""
    kind = draw(
        st.sampled_from(
            sorted(SCALARS) + [STRING, ARRAY, 13, 255] if depth < 2 else sorted(SCALARS)
        )
    )
    if kind in SCALARS:
        return kind, draw(
            st.binary(
                min_size=struct.calcsize(SCALARS[kind]), max_size=struct.calcsize(SCALARS[kind])
            )
        )
    if kind == STRING:
        text = draw(st.binary(max_size=12))
        return kind, _string(text, draw(st.none() | COUNTS))
    if kind == ARRAY:
        items = draw(st.lists(values(depth + 1), max_size=4))
        item_type = (
            items[0][0] if items else draw(st.sampled_from(sorted(SCALARS) + [STRING, ARRAY, 99]))
        )
        count = draw(st.just(len(items)) | COUNTS)
        return kind, struct.pack("<IQ", item_type, count) + b"".join(v for _, v in items)
    return kind, draw(st.binary(max_size=8))


KEYS = st.sampled_from(
    [
        b"general.architecture",
        b"general.alignment",
        b"llama.block_count",
        b"llama.embedding_length",
        b"llama.attention.head_count",
        b"llama.context_length",
        b"llama.feed_forward_length",
        b"tokenizer.ggml.model",
        b"tokenizer.ggml.tokens",
        b"tokenizer.ggml.merges",
        b"tokenizer.chat_template",
    ]
) | st.binary(max_size=10)


@st.composite
def kv_entries(draw):
    key = draw(KEYS)
    kind, value = draw(values())
    if key == b"general.architecture" and draw(st.booleans()):
        kind, value = (
            STRING,
            _string(draw(st.sampled_from([b"llama", b"qwen2", b"mistral", b"gpt2"]))),
        )
    return _string(key, draw(st.none() | st.just(2**60))) + struct.pack("<I", kind) + value


@st.composite
def tensor_infos(draw):
    name = draw(
        st.sampled_from([b"token_embd.weight", b"output_norm.weight", b"blk.0.attn_q.weight"])
        | st.binary(max_size=8)
    )
    dims = draw(st.lists(st.integers(min_value=0, max_value=64) | HUGE, max_size=5))
    n_dims = draw(st.just(len(dims)) | COUNTS)
    qtype = draw(st.sampled_from([0, 1, 2, 8, 12, 30, 39, 4, 5, 1000]))
    offset = draw(st.integers(min_value=0, max_value=256) | HUGE)
    return (
        _string(name)
        + struct.pack("<I", n_dims & 0xFFFFFFFF)
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", qtype, offset)
    )


@st.composite
def framed_files(draw):
    kvs = draw(st.lists(kv_entries(), max_size=6))
    infos = draw(st.lists(tensor_infos(), max_size=3))
    version = draw(st.sampled_from([3, 2, 1, 4, 3 << 24]))
    n_tensors = draw(st.just(len(infos)) | COUNTS)
    n_kv = draw(st.just(len(kvs)) | COUNTS)
    header = (
        b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(infos)
    )
    return header + bytes(draw(st.integers(min_value=0, max_value=300)))


@FAST
@given(st.binary(max_size=512))
def test_arbitrary_bytes_are_read_or_refused(data):
    _refused_or_read(data)


@FAST
@given(st.binary(max_size=256))
def test_arbitrary_bytes_after_the_magic_are_read_or_refused(data):
    _refused_or_read(b"GGUF" + struct.pack("<I", 3) + data)


@FAST
@given(framed_files())
def test_a_framed_header_that_lies_is_read_or_refused(data):
    _refused_or_read(data)


@pytest.mark.slow
@SLOW
@given(framed_files())
def test_a_framed_header_that_lies_is_read_or_refused_many(data):
    _refused_or_read(data)


def test_a_declared_string_of_2_to_the_60_is_refused_without_allocating():
    import tracemalloc

    for length in (2**60, 2**64 - 1, 2**40):
        body = (
            _string(b"general.architecture") + struct.pack("<I", STRING) + _string(b"llama", length)
        )
        path = _file(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body + bytes(64))
        tracemalloc.start()
        with pytest.raises(Refusal, match="the file ends first"):
            open_reader(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20


def test_an_array_of_2_to_the_60_items_is_refused_at_once():
    # GGUFReader itself loops on this one for ever: each item read past the end is empty
    body = _string(b"tokenizer.ggml.scores") + struct.pack("<IIQ", ARRAY, 6, 2**60)
    with pytest.raises(Refusal, match="file ends first"):
        open_reader(_file(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body + bytes(64)))


# ---- a real file, damaged ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_gguf() -> bytes:
    path = SCRATCH / "real.gguf"
    write_llama(path, layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    _open_everything(path)  # whole, it reads
    return path.read_bytes()


@FAST
@given(st.data())
def test_a_truncated_real_file_is_refused(real_gguf, data):
    cut = data.draw(st.integers(min_value=0, max_value=len(real_gguf) - 1))
    _refused_or_read(real_gguf[:cut])


@FAST
@given(st.data())
def test_a_real_file_with_changed_bytes_is_read_or_refused(real_gguf, data):
    raw = bytearray(real_gguf)
    header_end = min(len(raw), 4096)  # the header: counts, lengths, types and offsets live there
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        at = data.draw(st.integers(min_value=0, max_value=header_end - 1))
        raw[at] = data.draw(st.integers(min_value=0, max_value=255))
    _refused_or_read(bytes(raw))


@settings(
    max_examples=25,
    deadline=5000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_importing_a_damaged_real_file_writes_all_or_nothing(real_gguf, tmp_path, data):
    raw = bytearray(real_gguf)
    at = data.draw(st.integers(min_value=0, max_value=min(len(raw), 4096) - 1))
    raw[at] = data.draw(st.integers(min_value=0, max_value=255))
    out = tmp_path / f"out-{at}-{raw[at]}"
    shutil.rmtree(out, ignore_errors=True)
    try:
        report = import_gguf(_file(bytes(raw), "import.gguf"), out, to_safetensors=True)
    except Refusal as exc:
        assert "\n" not in str(exc)
        assert not out.exists() and not [
            p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")
        ]
    else:
        assert sorted(p.name for p in out.iterdir()) == report["files"]
