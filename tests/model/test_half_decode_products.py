"""A bf16 / f16 product of one row inside a compiled step (parallel/linear.dense's widening loop)
and the compiled head of a one-token step (model/compiled.CompiledLayers.head_product): the product
computed in f32 and rounded once, and a real bf16 model's compiled decode steps equal to its eager
ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ster_dist.load import load_model
from ster_dist import kernels
from ster_dist.parallel.linear import dense
from ster_dist.resolve import resolve
from ster_dist.load.toy import make_toy_model
from tests.model.test_compiled_step import compiling, decode  # noqa: F401  (a fixture and a helper)


def _as_if_not_built(monkeypatch) -> None:
    """dense() as in a process where the few-row kernel could not be built (kernels/__init__.py):
    bf16 rows take the widening loop then, f16 rows always do."""
    monkeypatch.setattr(kernels, "_tried", True)
    monkeypatch.setattr(kernels, "_ready", False)
    torch._dynamo.reset()  # graphs traced while the kernel was there hold it


@pytest.fixture
def without_few_rows(monkeypatch):
    _as_if_not_built(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_compiled_one_row_product_is_the_f32_product_rounded_once(
    dtype, with_bias, without_few_rows
):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 72, generator=gen).to(dtype)
    weight = torch.randn(97, 72, generator=gen).to(dtype)
    bias = torch.randn(97, generator=gen).to(dtype) if with_bias else None
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    got = torch.compile(dense, dynamic=False, fullgraph=True)(x, weight, bias)
    assert got.dtype == dtype and got.shape == (1, 1, 97)
    # within one rounding of each output (the sums' order differs from any kernel's)
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)
    # eagerly: F.linear itself
    assert torch.equal(dense(x, weight, bias), F.linear(x, weight, bias))


@torch.inference_mode()
@pytest.mark.parametrize("kernel_built", [True, False])
def test_compiled_bf16_decode_steps_equal_the_eager_ones(
    tmp_path, compiling, kernel_built, monkeypatch
):  # noqa: F811
    if not kernel_built:
        _as_if_not_built(monkeypatch)
    # the graphs, not native steps (tests/model/test_native_stack.py)
    monkeypatch.setenv("STER_NATIVE_STACK", "0")
    make_toy_model(tmp_path / "llama", layers=2, hidden=64, seed=7)
    eager = load_model(resolve(str(tmp_path / "llama")), precision="bf16").model
    compiled = load_model(resolve(str(tmp_path / "llama")), precision="bf16").model
    assert compiled.compile_layers() is None
    assert compiled.lm_head.product == compiled.compiled.head_product
    prompt = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(4))
    want, _ = decode(eager, prompt, 5)
    got, _ = decode(compiled, prompt, 5)
    graphs = compiled.compiled.graphs
    # the 9-token layers, the one-token stack, and without the few-row kernel the compiled one-row
    # head
    assert graphs >= (2 if kernels.ready() else 3)
    for w, g in zip(want, got):  # every step's logits: the prefill's and the one-token steps'
        rel = ((g.float() - w.float()).norm() / w.float().norm()).item()
        cos = F.cosine_similarity(g.float().flatten(), w.float().flatten(), dim=0).item()
        assert rel < 2e-2 and cos > 0.999, (rel, cos)
    decode(compiled, prompt, 3)
    assert compiled.compiled.graphs == graphs  # the second run compiled nothing more


@torch.inference_mode()
def test_a_head_that_fails_to_compile_runs_eagerly_from_then_on(
    tmp_path,
    compiling,
    capfd,  # noqa: F811
    without_few_rows,
):
    make_toy_model(tmp_path / "llama", layers=1, hidden=64, seed=8)
    model = load_model(resolve(str(tmp_path / "llama")), precision="bf16").model
    assert model.compile_layers() is None

    def untraceable(x, weight, bias):
        # a whole graph is asked for: dynamo raises instead of splitting it
        torch._dynamo.graph_break()
        return dense(x, weight, bias)

    model.compiled.head = torch.compile(untraceable, fullgraph=True)
    x = torch.randn(1, 1, 64).bfloat16()
    got = model.lm_head(x)
    assert torch.equal(got, dense(x, model.lm_head.weight))
    assert model.lm_head.product is dense  # and so on every later call
    assert "compiling the head failed" in capfd.readouterr().err
