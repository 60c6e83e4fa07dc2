"""The loader's arena (shard/arena.py): a CPU rank's parameters lie in one block, fused parts back
to back so fusing takes a view rather than a second copy, and a large block is advised to use huge
pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ster_dist.config import from_hf
from ster_dist.load import load_decoder
from ster_dist.parallel.linear import FusedColumns, joined
from ster_dist.shard.arena import HUGE_PAGE, Block, allocate
from ster_dist.shard.source import SafetensorsSource
from tests.tiny_models import make_tiny, read_config


@pytest.fixture(scope="module", params=["llama", "phi3", "gpt2"])
def loaded(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, directory)
    cfg = from_hf(read_config(directory))
    return load_decoder(cfg, SafetensorsSource(sorted(directory.glob("*.safetensors"))))


def _span(params) -> tuple[int, int]:
    return (
        min(p.data_ptr() for p in params),
        max(p.data_ptr() + p.numel() * p.element_size() for p in params),
    )


def test_parameters_lie_in_one_block_and_fusing_copies_nothing(loaded):
    params = list(loaded.parameters())
    low, high = _span(params)
    held = sum(p.numel() * p.element_size() for p in params)
    # back to back but for alignment between runs
    assert held <= high - low <= held + 64 * len(params)
    fused = [m for m in loaded.modules() if isinstance(m, FusedColumns) and m.weight is not None]
    assert fused
    for module in fused:
        first = next(p for p in module.parts if p is not None)
        # a view of the parts: no second copy
        assert module.weight.data_ptr() == first.weight.data_ptr()
        assert (
            module.weight.untyped_storage().data_ptr() == first.weight.untyped_storage().data_ptr()
        )


def test_each_run_has_a_storage_of_its_own(loaded):
    """One storage under every parameter would make them aliases to torch.compile, which then
    refuses the one-token stack (test_compiled_step); a run's members share one, so its fused
    product is a view."""
    storages = {}
    for param in loaded.parameters():
        storages.setdefault(param.untyped_storage().data_ptr(), []).append(param)
    runs = [run for m in loaded.modules() if isinstance(m, FusedColumns) for run in m.runs()]
    assert len(storages) == len(list(loaded.parameters())) - sum(len(run) - 1 for run in runs)


def test_a_run_is_laid_out_back_to_back_and_a_shared_parameter_once():
    model = nn.Module()
    # 15 + 5 floats: the run's members lie unpadded, wherever 64-byte rules would pad
    model.a = nn.Linear(3, 5)
    model.b = nn.Linear(3, 7)
    model.c = nn.Linear(3, 2)
    model.c.weight = model.a.weight  # tied: one tensor, placed once
    model = model.to("meta")
    model.c.weight = model.a.weight
    allocate(model, "cpu", [[model.a.weight, model.b.weight]])
    a, b = model.a.weight, model.b.weight
    assert b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
    assert model.c.weight is model.a.weight
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.c.weight.untyped_storage().data_ptr() != model.a.bias.untyped_storage().data_ptr()


def test_joined_views_adjacent_tensors_and_copies_the_rest():
    base = torch.arange(24.0)
    x, y = base[:8].view(2, 4), base[8:20].view(3, 4)
    view = joined([x, y])
    assert view.data_ptr() == x.data_ptr() and torch.equal(view, torch.cat([x, y]))
    gap = base[12:20].view(2, 4)  # not right after x: must be copied, with the right values
    out = joined([x, gap])
    assert out.data_ptr() != x.data_ptr() and torch.equal(out, torch.cat([x, gap]))
    assert torch.equal(joined([y, x]), torch.cat([y, x]))  # adjacent in the other order only


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _eligible(address: int) -> bool | None:
    """THPeligible of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


@pytest.mark.skipif(
    _thp_mode() not in ("madvise", "always"), reason="no transparent huge pages on this system"
)
def test_a_large_block_starts_on_a_huge_page_and_may_use_them():
    block = Block(6 * HUGE_PAGE + 100)
    piece = block.piece(0, 6 * HUGE_PAGE + 100)
    assert piece.data_ptr() % HUGE_PAGE == 0
    assert _eligible(piece.data_ptr() + HUGE_PAGE) is True  # advised before the first write
    piece.fill_(7)
    assert int(block.piece(HUGE_PAGE, 3).sum()) == 21  # pieces of one block are the same memory
