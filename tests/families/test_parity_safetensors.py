"""Issue 19: the parity reference reads the safetensors only; a pytorch_model.bin beside them (a
pickle, which can run code when loaded) is never opened, whatever the safetensors are named."""

from __future__ import annotations

import pathlib
import pickle
from types import SimpleNamespace

import pytest
import torch

from ster_dist.errors import Refusal
from ster_dist.parity import reference_model
from ster_dist.resolve import resolve
from tests.tiny_models import make_tiny


class _Touch:
    """Unpickling this creates the marker file: the proof that something unpickled the .bin."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    make_tiny("llama", directory)
    return directory


def _planted(tiny, tmp_path, weights_name: str):
    """A copy of the tiny checkpoint, its weights named weights_name, a booby-trapped
    pytorch_model.bin beside."""
    directory = tmp_path / "model"
    directory.mkdir()
    for item in tiny.iterdir():
        (directory / (weights_name if item.name == "model.safetensors" else item.name)).write_bytes(
            item.read_bytes()
        )
    marker = tmp_path / "unpickled"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": _Touch(str(marker))}))
    return directory, marker


@pytest.fixture
def loads(monkeypatch):
    """Every path torch.load is asked to open; refused, so nothing is unpickled even if it is
    asked."""
    seen = []

    def refuse(path, *args, **kwargs):
        seen.append(str(path))
        raise RuntimeError("torch.load called by the parity reference")

    monkeypatch.setattr(torch, "load", refuse)
    return seen


def _reference(directory):
    return reference_model(SimpleNamespace(checkpoint=resolve(str(directory))), torch.float32)


def test_the_reference_loads_model_safetensors_and_never_the_bin(tiny, tmp_path, loads):
    directory, marker = _planted(tiny, tmp_path, "model.safetensors")
    assert _reference(directory) is not None
    assert loads == [] and not marker.exists()


def test_safetensors_transformers_cannot_name_are_refused_not_replaced_by_the_bin(
    tiny, tmp_path, loads
):
    """ster_dist reads any *.safetensors; Transformers only its own names and else fell back to the
    .bin."""
    directory, marker = _planted(tiny, tmp_path, "weights.safetensors")
    with pytest.raises(
        Refusal, match=r"^Transformers cannot load the reference from .*name the weights so$"
    ):
        _reference(directory)
    assert loads == [] and not marker.exists()
