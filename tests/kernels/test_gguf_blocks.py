"""GGUF Q8_0/Q4_0/Q4_1 weights run as stored (parallel/ggml.py, kernels/blocks.cpp,
shard/ggml_kept.py): the kernel against gguf.quants, the loader keeping each rank's blocks, and
greedy tokens against the dequantized model.

The references are the gguf package's own: `dequantize` of the stored blocks for the weights, and,
where the kernel quantizes activations to 8 bits per block as llama.cpp does, `quantize(x, Q8_0)`
then
`dequantize` for
the activations, multiplied in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from ster_dist import kernels
from ster_dist.errors import Refusal
from ster_dist.gguf.importer import import_gguf
from ster_dist.load import load_model
from ster_dist.parallel import linear
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.ggml import KINDS, BlockWeight, block_product, dequantize_blocks
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import engine_tokens
from tests.gguf_fixtures import write_llama

KEPT = (Q.Q8_0, Q.Q4_0, Q.Q4_1)
needs_kernels = pytest.mark.skipif(
    not kernels.ready(), reason="ster_dist's CPU kernels could not be built here"
)


def stored(
    rng: np.random.Generator, qtype: Q, rows: int, cols: int
) -> tuple[np.ndarray, np.ndarray]:
    """(stored blocks, their float32 dequantization by the gguf package) of a random [rows, cols]
    matrix."""
    blocks = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return blocks, dequantize(blocks, qtype).reshape(rows, cols)


@pytest.mark.parametrize("qtype", KEPT)
def test_dequantized_blocks_equal_gguf_dequantize(qtype):
    blocks, reference = stored(np.random.default_rng(1), qtype, 37, 160)
    ours = dequantize_blocks(torch.from_numpy(blocks), qtype.name, 160)
    assert np.array_equal(ours.numpy(), reference)


@needs_kernels
@pytest.mark.parametrize("qtype", KEPT)
@pytest.mark.parametrize(
    "rows, outputs, cols", [(1, 37, 96), (5, 70, 160), (64, 33, 64), (9, 48, 576)]
)
def test_block_kernel_equals_gguf_reference(qtype, rows, outputs, cols):
    """Output counts not a multiple of any lane or thread share (37, 33); 1, 5, 9 and 64 rows of
    x."""
    rng = np.random.default_rng(rows * outputs)
    blocks, weight = stored(rng, qtype, outputs, cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    bias = rng.standard_normal(outputs).astype(np.float32)
    # activations as llama.cpp rounds them
    x8 = dequantize(quantize(x, Q.Q8_0), Q.Q8_0).reshape(rows, cols)
    reference = x8.astype(np.float64) @ weight.astype(np.float64).T + bias
    y = block_product(
        torch.from_numpy(x),
        BlockWeight(torch.from_numpy(blocks), qtype.name, cols, torch.float32),
        torch.from_numpy(bias),
    ).numpy()
    assert np.abs(y - reference).max() <= 1e-5 * np.abs(reference).max()
    # and within 8-bit activations of f32's
    exact = x.astype(np.float64) @ weight.astype(np.float64).T + bias
    assert np.abs(y - exact).max() <= 0.03 * np.abs(exact).max()
    wide = block_product(
        torch.from_numpy(x).bfloat16(),
        BlockWeight(torch.from_numpy(blocks), qtype.name, cols, torch.bfloat16),
        None,
    )
    assert wide.dtype == torch.bfloat16 and wide.shape == (rows, outputs)


@needs_kernels
def test_many_rows_go_through_dequantized_tiles_and_refusals_name_the_problem():
    rng = np.random.default_rng(3)
    blocks, weight = stored(rng, Q.Q4_1, 40, 96)
    x = rng.standard_normal((100, 96)).astype(np.float32)
    y = block_product(
        torch.from_numpy(x), BlockWeight(torch.from_numpy(blocks), "Q4_1", 96, torch.float32), None
    )
    # prefill: no activation rounding
    assert np.allclose(y.numpy(), x @ weight.T, rtol=1e-4, atol=1e-4)
    product = torch.ops.ster_kernels.block_product
    with pytest.raises(RuntimeError, match="GGML type 6 is not Q8_0"):
        product(torch.zeros(1, 96), torch.from_numpy(blocks), None, 6, 96)
    with pytest.raises(RuntimeError, match="not whole blocks of 32"):
        product(torch.zeros(1, 80), torch.from_numpy(blocks), None, 3, 80)
    # truncated: a row one block short
    with pytest.raises(RuntimeError, match=r"uint8 \[rows, 60\]"):
        product(torch.zeros(1, 96), torch.from_numpy(blocks[:, :40].copy()), None, 3, 96)


def reference_dense(x, weight, bias=None):
    """The dequantized model's product with x rounded to Q8_0 blocks by the gguf package, where the
    block kernel takes x (up to 64 rows): what the kept blocks compute, without their code."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= 64:
        rounded = dequantize(quantize(rows.float().numpy(), Q.Q8_0), Q.Q8_0).reshape(rows.shape)
        x = torch.from_numpy(rounded).view(x.shape).to(x.dtype)
    y = x.double() @ weight.double().t()
    return (y if bias is None else y + bias.double()).to(x.dtype)


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """Each kept kind imported twice: its blocks linked (run as stored) and dequantized to
    safetensors."""
    made = {}
    for qtype in KEPT:
        where = tmp_path_factory.mktemp(qtype.name)
        write_llama(where / "m.gguf", qtype=qtype, inter=128, tie=qtype != Q.Q8_0, seed=1)
        import_gguf(where / "m.gguf", where / "blocks")
        import_gguf(where / "m.gguf", where / "dense", to_safetensors=True)
        made[qtype] = where
    return made


PROMPT = [5, 17, 40, 3, 99]


@needs_kernels
@pytest.mark.parametrize("qtype", KEPT)
def test_imported_blocks_run_as_stored_and_decode_as_the_dequantized_model(
    imports, qtype, monkeypatch
):
    where = imports[qtype]
    loaded = load_model(resolve(str(where / "blocks")), "f32", weights="blocks")
    kept = loaded.model
    held = {name: p for name, p in kept.named_parameters() if p.dtype == torch.uint8}
    # every projection (q/k/v and gate/up fused), the embedding and (untied) the head hold the
    # file's bytes
    assert len(held) == 2 * 7 + 1 + (qtype == Q.Q8_0), sorted(held)
    file_bytes = sum(int(np.prod(t.shape)) for t in held.values())
    assert file_bytes < (where / "m.gguf").stat().st_size
    ours = engine_tokens(loaded, [PROMPT], 16)[0]
    monkeypatch.setattr(linear, "dense", reference_dense)
    dense = load_model(resolve(str(where / "dense")), "f32")
    assert engine_tokens(dense, [PROMPT], 16)[0] == ours


@pytest.mark.slow  # two spawned ranks: about 40 s here
@needs_kernels
def test_tp2_ranks_hold_their_blocks_and_decode_as_one_rank(imports):
    where = imports[Q.Q4_1]
    one = engine_tokens(
        load_model(resolve(str(where / "blocks")), "f32", weights="blocks"), [PROMPT], 16
    )[0]
    checkpoint = resolve(str(where / "blocks"))
    with SpawnGroup(2) as group:
        group.call("load", checkpoint, "f32", "cpu", "blocks")
        assert engine_tokens(group, [PROMPT], 16, checkpoint=checkpoint)[0] == one


def test_tp_split_inside_a_block_is_refused_naming_the_block(tmp_path):
    # down_proj's 96 inputs: 48 a rank, not whole blocks
    write_llama(tmp_path / "m.gguf", qtype=Q.Q4_0, inter=96)
    import_gguf(tmp_path / "m.gguf", tmp_path / "blocks")
    said = r"takes columns 0-48 of model.layers.0.mlp.down_proj.weight, which cut its Q4_0 blocks of 32"
    with pytest.raises(Refusal, match=said):
        load_model(
            resolve(str(tmp_path / "blocks")),
            "f32",
            ctx=ParallelCtx(tp_rank=0, tp_size=2),
            weights="blocks",
        )


def _damaged(path, how: str) -> None:
    """The .gguf at `path` changed in place: cut short, or blk.0.ffn_down's type or first dimension
    rewritten."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[:-10]))
        return
    name = b"blk.0.ffn_down.weight"
    # then: n_dims (4 bytes), dims (8 each, innermost first), type (4)
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    if how == "unknown type":
        data[at + 4 + 8 * n_dims : at + 8 + 8 * n_dims] = (99).to_bytes(4, "little")
    else:
        data[at + 4 : at + 12] = (80).to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how, said",
    [
        ("truncated", "reaches past the end of the file"),
        ("unknown type", "has storage type 99, which GGUF does not define"),
        ("partial block", "has rows of 80 values, not whole Q4_1 blocks of 32"),
    ],
)
def test_a_damaged_gguf_directory_is_refused_in_one_line_before_loading(tmp_path, how, said):
    write_llama(tmp_path / "m.gguf", qtype=Q.Q4_1, inter=128)
    import_gguf(tmp_path / "m.gguf", tmp_path / "blocks")
    linked = tmp_path / "blocks" / "m.gguf"
    linked.unlink()  # its own copy, so the damage is to it alone
    linked.write_bytes((tmp_path / "m.gguf").read_bytes())
    _damaged(linked, how)
    with pytest.raises(Refusal, match=said) as refused:
        load_model(resolve(str(tmp_path / "blocks")), "f32", weights="blocks")
    assert "\n" not in str(refused.value)
