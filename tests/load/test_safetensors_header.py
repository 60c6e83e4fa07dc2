"""Damaged safetensors headers are refused in one line before any tensor is read (issue 19)."""

import json
import os
import struct
import threading

import pytest
import torch
from safetensors.torch import save_file

from ster_dist.errors import Refusal
from ster_dist.shard.safetensors_header import entries, header_bytes, read_header
from ster_dist.shard.source import SafetensorsSource


def write(path, header, data: bytes = bytes(16)) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def refusal(path) -> str:
    with pytest.raises(Refusal) as info:
        SafetensorsSource([path])
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "re-download it" in message
    return message


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header, named",
    [
        # was read from the header
        ({"w": {**F32, "data_offsets": [-8, 0]}}, "tensor w has data_offsets [-8, 0]"),
        ({"w": {**F32, "data_offsets": [8, 0]}}, "tensor w has data_offsets [8, 0]"),
        ({"w": {**F32, "data_offsets": [16, 24]}}, "outside its 16-byte data"),
        (
            {"w": {**F32, "data_offsets": [0, 12]}},
            "tensor w has 12 bytes of data for shape [2] in F32",
        ),
        ({"w": {**F32, "data_offsets": [0.0, 8]}}, "not two integers"),
        ({"w": {**F32, "data_offsets": [0]}}, "not two integers"),
        ([F32], "is a JSON list, not an object"),
        ({"w": "F32"}, "tensor w has a JSON str for its entry"),
        ({"w": {**F32, "shape": ["2"]}}, "tensor w has shape ['2']"),
        ({"w": {**F32, "shape": [-2]}}, "not a list of non-negative integers"),
        ({"w": {**F32, "shape": [True, 2]}}, "not a list of non-negative integers"),
        ({"w": {**F32, "dtype": "Q4"}}, "tensor w has dtype 'Q4'"),
        ({"w": {**F32, "dtype": ["F32"]}}, "tensor w has dtype"),
        ({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, "tensor b's data overlaps tensor a's"),
        ({"__metadata__": {"format": 1}, "w": F32}, "__metadata__ is not an object of strings"),
        ({"__metadata__": ["pt"], "w": F32}, "__metadata__ is not an object of strings"),
    ],
)
def test_a_damaged_header_is_refused_naming_the_tensor(tmp_path, header, named):
    path = tmp_path / "model.safetensors"
    write(path, header)
    assert named in refusal(path)


def test_a_header_length_past_the_file_or_the_bound_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    assert "claims 1099511627776 bytes" in refusal(path)
    path.write_bytes(struct.pack("<Q", 64) + b"{}")
    assert "claims 64 bytes of a 10-byte file" in refusal(path)
    path.write_bytes(b"\x01")
    assert "shorter than its 8-byte header length" in refusal(path)


def test_a_header_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    write(path, b"\xff\xfe not json")
    assert "its header is not JSON" in refusal(path)
    write(path, b"[" * 100_000 + b"]" * 100_000)  # nesting past the recursion limit
    assert "its header is not JSON" in refusal(path) or "JSON list" in refusal(path)


def test_a_valid_file_still_reads(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    source = SafetensorsSource([path])
    try:
        for name, tensor in tensors.items():
            assert torch.equal(source.read(name), tensor)
    finally:
        source.close()
    assert read_header(path).metadata == {"format": "pt"}


def test_header_bytes_round_trip(tmp_path):
    path = tmp_path / "model.safetensors"
    specs = [("a", "F32", (2, 3)), ("b", "BF16", (0,)), ("c", "I8", (5,))]
    raw = header_bytes(specs, {"k": "v"})
    path.write_bytes(raw + bytes(24 + 5))
    assert [(e.name, e.dtype, e.shape, e.nbytes) for e in entries(path)] == [
        ("a", "F32", (2, 3), 24),
        ("b", "BF16", (0,), 0),
        ("c", "I8", (5,), 5),
    ]


def test_a_tensor_named_twice_in_one_header_is_refused(tmp_path):
    # json.loads would keep the last entry, silently; merge refused this, the loader and ster plan
    # did not
    path = tmp_path / "model.safetensors"
    write(path, b'{"w": ' + json.dumps(F32).encode() + b', "w": ' + json.dumps(F32).encode() + b"}")
    with pytest.raises(
        Refusal, match="model weight w appears twice in model.safetensors; .* re-export it"
    ):
        SafetensorsSource([path])
    write(path, b'{"w": {"dtype": "F32", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}')
    # a key repeated inside one entry is not a tensor twice
    assert list(read_header(path).tensors) == ["w"]


def test_a_directory_or_fifo_is_refused_without_waiting(tmp_path):
    directory = tmp_path / "model.safetensors"
    directory.mkdir()
    assert "it is not a regular file" in refusal(directory)
    fifo = tmp_path / "model-00002-of-00002.safetensors"
    os.mkfifo(fifo)
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(refusal(fifo)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # blocked opening the FIFO for a writer: be one, so the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert found and "it is not a regular file" in found[0]


def test_a_missing_file_is_not_called_damaged_json(tmp_path):
    assert "it cannot be opened (No such file or directory)" in refusal(
        tmp_path / "gone.safetensors"
    )
