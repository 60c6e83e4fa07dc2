"""Whole-model greedy decoding with `--kernels triton` (the Triton attention kernels, under Triton's
interpreter on the CPU) against the default path, through `ster generate`'s operation: a prompt's
prefill goes through the extend kernel, every later token through the split-KV decode kernel (MLA's
through the latent one), experts through the fused kernel, kept FP8 products through the block GEMM.
And the selection's refusals."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    # before the kernel modules are imported: their jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from ster_dist.errors import Refusal  # noqa: E402
from ster_dist.kernels import select  # noqa: E402
from ster_dist.cli import parse  # noqa: E402
from tests.cli_run import cli_generate, make_toy  # noqa: E402


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def _counted(calls: dict, name: str, kernel):
    """The real kernel, its calls counted: a step must go through it, not fall back."""

    def run(*args, **kwargs):
        calls[name] += 1
        return kernel(*args, **kwargs)

    return run


@pytest.fixture(autouse=True)
def native_after():
    yield
    select.choose("native", "cpu")  # the process's choice back to the CPU default for later tests


def test_triton_kernels_decode_as_the_default_path(toy, monkeypatch):
    from ster_dist.kernels.triton import decode, extend

    calls = {"decode": 0, "extend": 0}
    monkeypatch.setattr(decode, "paged_decode", _counted(calls, "decode", decode.paged_decode))
    monkeypatch.setattr(extend, "paged_extend", _counted(calls, "extend", extend.paged_extend))
    args = (
        f"--model={toy}",
        "--prompt=the quick brown fox jumps over the lazy dog again and again",
        "--max-new-tokens=12",
        "--chat-template=off",
    )
    triton = cli_generate(*args, "--kernels=triton")
    assert select.chosen() == "triton"
    layers = 2  # the toy's: a prefill through extend, then a decode per later token, every layer
    assert calls == {"extend": layers, "decode": layers * 11}
    torch_path = cli_generate(*args, "--kernels=torch")
    native = cli_generate(*args)
    assert triton["text"] == native["text"] == torch_path["text"]
    assert len(triton["text"]) > 0


@pytest.mark.slow  # about 10 s here
def test_triton_mla_and_experts_decode_as_the_default_path(tmp_path, monkeypatch):
    """A tiny DeepSeek-V3: its MLA decodes through the latent kernel (its prompt through torch's
    expanded path) and its SwiGLU experts through the fused kernel; the greedy tokens are the
    default path's."""
    from ster_dist.kernels.triton import mla, moe
    from ster_dist.load.toy import make_toy_model

    calls = {"mla": 0, "experts": 0}
    monkeypatch.setattr(mla, "mla_decode", _counted(calls, "mla", mla.mla_decode))
    monkeypatch.setattr(moe, "fused_experts", _counted(calls, "experts", moe.fused_experts))
    make_toy_model(tmp_path / "model", family="deepseek_v3", layers=2, hidden=64, seed=0)
    args = (
        f"--model={tmp_path / 'model'}",
        "--prompt=the quick brown fox",
        "--max-new-tokens=6",
        "--chat-template=off",
    )
    assert cli_generate(*args, "--kernels=triton")["text"] == cli_generate(*args)["text"]
    # every decode's MLA layers; every step's MoE layer
    assert calls["mla"] == 2 * 5 and calls["experts"] >= 6


def test_triton_refused_off_cuda_without_the_interpreter(monkeypatch, toy):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # from the request, unloaded
    with pytest.raises(Refusal, match="--kernels triton runs on CUDA, not on cpu"):
        parse(["generate", f"--model={toy}", "--prompt=hi", "--kernels=triton"])
    with pytest.raises(Refusal, match="--kernels triton runs on CUDA"):
        select.choose("triton", "cpu")
    with pytest.raises(ValueError, match="choose one of"):
        select.choose("cutlass", "cpu")


@pytest.mark.slow  # about 60 s here (two loads of an FP8 checkpoint, every product interpreted)
def test_triton_fp8_products_and_experts_decode_as_the_default_path(tmp_path, monkeypatch):
    """A tiny DeepSeek-V3 kept in FP8 (16 x 16 scale blocks, test_fp8's builder): its dense FP8
    products go through the block GEMM, its experts through the fused kernel in FP8, greedy tokens
    equal to the default path's."""
    from safetensors.torch import load_file

    from ster_dist.kernels.triton import fp8, moe
    from tests.load.test_fp8 import BLOCKS, write_fp8
    from tests.tiny_models import make_tiny

    make_tiny("deepseek_v3", tmp_path / "source")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    write_fp8(
        load_file(str(tmp_path / "source" / "model.safetensors")),
        BLOCKS["deepseek_v3"],
        tmp_path / "source",
        tmp_path / "fp8",
        tmp_path / "ref",
        config,
    )
    calls = {"gemm": 0, "experts": 0}
    monkeypatch.setattr(fp8, "block_gemm", _counted(calls, "gemm", fp8.block_gemm))
    monkeypatch.setattr(moe, "fused_experts", _counted(calls, "experts", moe.fused_experts))
    args = (
        f"--model={tmp_path / 'fp8'}",
        "--prompt=the quick brown fox",
        "--chat-template=off",
        "--max-new-tokens=5",
        "--ignore-eos",
        "--weights=fp8",
    )
    assert cli_generate(*args, "--kernels=triton")["text"] == cli_generate(*args)["text"]
    assert calls["gemm"] > 0 and calls["experts"] > 0


@pytest.mark.slow  # about 70 s on this loaded machine (Transformers builds the checkpoint)
def test_triton_qwen3_moe_decodes_as_the_default_path(tmp_path, monkeypatch):
    """A tiny qwen3_moe (GQA attention with q/k norms, SwiGLU experts): attention through the extend
    and decode kernels, experts through the fused kernel, greedy tokens equal to the default
    path's."""
    from ster_dist.kernels.triton import decode, moe
    from tests.tiny_models import make_tiny

    make_tiny("qwen3_moe", tmp_path / "model")
    calls = {"decode": 0, "experts": 0}
    monkeypatch.setattr(decode, "paged_decode", _counted(calls, "decode", decode.paged_decode))
    monkeypatch.setattr(moe, "fused_experts", _counted(calls, "experts", moe.fused_experts))
    args = (
        f"--model={tmp_path / 'model'}",
        "--prompt=the quick brown fox",
        "--max-new-tokens=6",
        "--chat-template=off",
        "--ignore-eos",
    )
    assert cli_generate(*args, "--kernels=triton")["text"] == cli_generate(*args)["text"]
    assert calls["decode"] > 0 and calls["experts"] > 0
