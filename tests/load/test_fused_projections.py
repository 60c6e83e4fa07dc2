"""Fused projections (q/k/v, gate/up as one product once loaded) and the kernel `dense` picks per
shape:
a loaded model runs each fused product once, its parts' parameters are views of it, and the logits
equal those of the same weights run part by part; the row-block batched product equals F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ster_dist.config import from_hf
from ster_dist.load import load_decoder
from ster_dist.model.decoder import meta_decoder
from ster_dist.parallel.linear import SPLIT_ROWS_MAX, ColumnLinear, FusedColumns, dense
from ster_dist.shard.loader import fill_module
from ster_dist.shard.source import SafetensorsSource
from tests.tiny_models import make_tiny, read_config


@pytest.fixture(scope="module", params=["llama", "qwen3_next", "phi3"])
def loaded(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, directory)
    cfg = from_hf(read_config(directory))
    files = sorted(directory.glob("*.safetensors"))
    fused = load_decoder(cfg, SafetensorsSource(files))
    parts = meta_decoder(cfg)
    # filled, never fused: each part its own product
    fill_module(parts, cfg, SafetensorsSource(files))
    return cfg, fused, parts.eval()


def _fused_modules(model):
    return [m for m in model.modules() if isinstance(m, FusedColumns)]


def test_parts_are_views_of_one_product(loaded):
    _, fused, parts = loaded
    modules = _fused_modules(fused)
    assert modules and all(m.weight is not None for m in modules)
    assert all(m.weight is None for m in _fused_modules(parts))
    for module in modules:
        start = module.weight.data_ptr()
        end = start + module.weight.numel() * module.weight.element_size()
        members = [p for p in module.parts if p is not None]
        assert sum(p.weight.shape[0] for p in members) == module.weight.shape[0]
        for part in members:
            assert start <= part.weight.data_ptr() < end  # shares the fused storage: no second copy


def test_fused_logits_equal_part_by_part(loaded):
    cfg, fused, parts = loaded
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.inference_mode():
        a, b = fused(ids), parts(ids)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_adapter_on_a_part_applies_to_its_slice_only(loaded):
    cfg, fused, parts = loaded
    from ster_dist.parallel.linear import LowRank

    ids = torch.randint(0, cfg.vocab_size, (1, 7))
    generator = torch.Generator().manual_seed(0)
    added = []
    for model in (fused, parts):
        v = next(block.attn.v for block in model.layers if hasattr(block, "attn"))
        a = torch.randn(4, v.weight.shape[1], generator=generator)
        b = torch.randn(v.weight.shape[0], 4, generator=generator)
        generator.manual_seed(0)
        low = LowRank(a, b, 0.5)
        v.adapters.append(low)
        added.append((v, low))
    try:
        with torch.inference_mode():
            x, y = fused(ids), parts(ids)
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-5)
    finally:
        for module, low in added:
            module.adapters.remove(low)
    with torch.inference_mode():
        plain = fused(ids)
    assert not torch.allclose(plain, x, atol=1e-4)  # the adapter did change the output


@pytest.mark.parametrize("rows", [1, 2, 7, SPLIT_ROWS_MAX, SPLIT_ROWS_MAX + 1])
@pytest.mark.parametrize("out", [96, 97])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_equals_linear(rows, out, dtype):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the row-block path runs only with more than one thread
    try:
        x = torch.randn(3, rows, 40, dtype=dtype)
        weight, bias = torch.randn(out, 40, dtype=dtype), torch.randn(out, dtype=dtype)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        assert torch.allclose(dense(x, weight, bias), F.linear(x, weight, bias), **tol)
        assert torch.allclose(dense(x[0, :1], weight), F.linear(x[0, :1], weight), **tol)
    finally:
        torch.set_num_threads(threads)


def test_parts_that_cannot_share_one_product_stay_apart():
    with_bias, without = ColumnLinear(8, 4, ((0, 4),), True), ColumnLinear(8, 4, ((0, 4),), False)
    for p in (with_bias, without):
        p.weight.data.normal_()
    with_bias.bias.data.normal_()
    module = FusedColumns(with_bias, without, None)
    module.fuse()
    assert module.weight is None
    x = torch.randn(2, 8)
    y = module(x)
    assert y[2] is None and torch.allclose(y[0], with_bias(x)) and torch.allclose(y[1], without(x))


def test_half_precision_prefill_products_run_upcast_block_by_block(monkeypatch):
    """The f32 route of bf16 products of many rows, in blocks of weight rows smaller than the weight
    (the last block partial), equals the product computed in f32 and rounded once."""
    from ster_dist.parallel import linear

    monkeypatch.setattr(linear, "NATIVE_HALF_PRODUCTS", False)
    # 7 weight rows a block: 97 rows is 14 blocks
    monkeypatch.setattr(linear, "UPCAST_BLOCK", 40 * 7)
    x = torch.randn(2, linear.UPCAST_ROWS_MIN, 40).bfloat16()
    weight, bias = torch.randn(97, 40).bfloat16(), torch.randn(97).bfloat16()
    want = F.linear(x.float(), weight.float(), bias.float()).bfloat16()
    got = dense(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    # one row is left to a bf16 kernel (the few-row one, or F.linear without it): the same product,
    # rounded once
    one = dense(x[:, :1], weight, bias)
    assert one.dtype == torch.bfloat16 and torch.allclose(
        one.float(), want[:, :1].float(), rtol=1e-2, atol=1e-2
    )


def test_f32_products_of_many_rows_through_onednn_take_any_strides_and_give_linear_s_gradients():
    """Rows past ONEDNN_ROWS_MIN go to oneDNN's matmul through an operator of ours
    (parallel/linear.py), with the backward F.linear would give for the input, the weight and the
    bias."""
    from ster_dist.parallel.linear import ONEDNN_ROWS_MIN

    weight, bias = torch.randn(96, 40), torch.randn(96)
    for x in (
        torch.randn(40, ONEDNN_ROWS_MIN + 3).t(),
        torch.randn(2, 40, 2 * ONEDNN_ROWS_MIN).transpose(1, 2),
    ):
        assert not x.is_contiguous()
        assert torch.allclose(
            dense(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5
        )
    grads = []
    for product in (dense, F.linear):
        x = torch.randn(
            2, ONEDNN_ROWS_MIN, 40, generator=torch.Generator().manual_seed(0)
        ).requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        product(x, w, b).square().sum().backward()
        grads.append((x.grad, w.grad, b.grad))
    for got, want in zip(*grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)
    # a frozen weight (an adapter's base): x's grad only
    x = torch.randn(ONEDNN_ROWS_MIN, 40, requires_grad=True)
    dense(x, weight).sum().backward()
    assert torch.allclose(x.grad, weight.sum(0).expand(ONEDNN_ROWS_MIN, 40), rtol=1e-5, atol=1e-5)
