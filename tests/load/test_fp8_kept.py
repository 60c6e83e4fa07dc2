"""`--weights fp8`: FP8 checkpoints kept in FP8 with their block scales, against the same checkpoint
dequantized while loading (the default, which tests/load/test_fp8.py holds to Transformers).

Tiny deepseek_v3 and qwen3_moe checkpoints are quantized here with the real block scheme (test_fp8's
builders: blocks that straddle the tensor-parallel splits and leave partial blocks). Kept logits
equal the dequantized ones at TP=1, TP=2 and EP=2 over real gloo groups; each rank holds its share's
FP8 bytes plus the scale entries covering it (counted from the model's own tensors against the
plan's windows) and reads what it read before; `ster plan --weights fp8` states those held bytes.
Greedy generation through the token engine (decode steps: MLA's absorbed path) and an unmerged
adapter agree across the two modes. Refusals: fp8 on a checkpoint with no FP8 weights, on MXFP4, and
merge onto an FP8 base.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.adapters.attach import attach
from ster_dist.config.load import model_config
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.ops.plan import plan
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import module_shards
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.schema.plan import PlanRequest
from ster_dist.shard.plan import build_plan
from ster_dist.shard.safetensors_header import read_header
from tests.cli_run import cli_generate
from tests.load.test_fp8 import BLOCKS, IDS, expected_bytes, mtp_tensors, write_fp8
from tests.tiny_models import make_tiny

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """variant -> a directory holding fp8/ and its float32 twin ref/; qwen3_moe also stacked/fp8,
    its experts stacked as Transformers 5 holds them (experts.gate_up_proj [experts, 2 x inner,
    hidden]) and quantized in blocks over each expert's matrix."""
    out = {}
    for variant in ("deepseek_v3", "qwen3_moe"):
        root = tmp_path_factory.mktemp(variant)
        model = make_tiny(variant, root / "source")
        tensors = load_file(str(root / "source" / "model.safetensors"))
        config = json.loads((root / "source" / "config.json").read_text())
        if variant == "deepseek_v3":  # as published: one MTP layer after the decoder's
            config["num_nextn_predict_layers"] = 1
            tensors.update(
                mtp_tensors(
                    tensors,
                    config["num_hidden_layers"],
                    config["hidden_size"],
                    config["vocab_size"],
                )
            )
        write_fp8(tensors, BLOCKS[variant], root / "source", root / "fp8", root / "ref", config)
        if variant == "qwen3_moe":
            state = {
                k: v.contiguous() for k, v in model.state_dict().items() if "rotary_emb" not in k
            }
            (root / "stacked").mkdir()
            write_fp8(
                state,
                BLOCKS[variant],
                root / "source",
                root / "stacked" / "fp8",
                root / "stacked" / "ref",
                config,
            )
        out[variant] = root
    return out


def _equal(kept: torch.Tensor, dequantized: torch.Tensor) -> None:
    # the same products in another grouping (kept parts run unfused): equal up to f32 rounding
    result = compare(kept, dequantized)
    assert result["max_relative_error"] < 1e-5 and result["mean_cosine"] > 0.999999, result


def held_fp8_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(FP8 parameter bytes, their scale buffers' bytes), from the model's own tensors."""
    fp8 = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype == FP8)
    scales = sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("_scale")
    )
    return fp8, scales


def share_of_quantized(directory: Path, ctx: ParallelCtx) -> tuple[int, int, int]:
    """(FP8 elements, covering scale entries, parameters filled) of this rank's windows of the
    quantized tensors, from the shard plan's pieces and the files' headers."""
    checkpoint = resolve(str(directory))
    cfg = model_config(checkpoint)
    stored = {
        n: tuple(i["shape"])
        for p in checkpoint.weight_files
        for n, i in read_header(p).tensors.items()
    }
    plan_ = build_plan(
        cfg.spec,
        cfg,
        module_shards(meta_decoder(cfg, ctx)),
        {n: s for n, s in stored.items() if not n.endswith("_scale_inv")},
    )
    b0, b1 = cfg.quant.block
    elements = entries = 0
    params = set()
    for read in plan_.reads:
        if read.source + "_scale_inv" not in stored:
            continue
        params.add(read.param)
        shape = stored[read.source]
        for piece in read.pieces:
            window = piece.window or (piece.rows or slice(None), piece.cols or slice(None))
            window = (tuple(window) + (slice(None),) * len(shape))[: len(shape)]
            *lead, (r0, r1), (c0, c1) = [w.indices(n)[:2] for w, n in zip(window, shape)]
            count = math.prod(b - a for a, b in lead)
            elements += count * (r1 - r0) * (c1 - c0)
            entries += count * (-(-r1 // b0) - r0 // b0) * (-(-c1 // b1) - c0 // b1)
    return elements, entries, len(params)


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_kept_fp8_equals_dequantized_and_holds_fp8_bytes_and_covering_scales(checkpoints, variant):
    fp8_dir = checkpoints[variant] / "fp8"
    checkpoint = resolve(str(fp8_dir))
    dequantized = load_model(checkpoint, "f32")
    kept = load_model(checkpoint, "f32", weights="fp8")
    with torch.no_grad():
        _equal(kept.model(IDS), dequantized.model(IDS))
    assert kept.bytes_read == dequantized.bytes_read == expected_bytes(fp8_dir, ParallelCtx())
    elements, entries, params = share_of_quantized(fp8_dir, ParallelCtx())
    assert held_fp8_bytes(kept.model) == (elements, entries * 4)
    # every quantized projection kept
    assert sum(p.dtype == FP8 for p in kept.model.parameters()) == params
    if variant == "qwen3_moe":
        return
    # at bf16 both round the same float32 dequantization once: still equal up to the products'
    # rounding
    with torch.no_grad():
        ours = load_model(checkpoint, "bf16", weights="fp8").model(IDS).float()
        theirs = load_model(checkpoint, "bf16").model(IDS).float()
    assert compare(ours, theirs)["mean_cosine"] > 0.9999


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_kept_fp8_under_tp2_and_ep2_equals_dequantized_and_reads_the_same_bytes(
    checkpoints, tp2, ep2, variant
):
    fp8_dir = checkpoints[variant] / "fp8"
    checkpoint = resolve(str(fp8_dir))
    with torch.no_grad():
        want = load_model(checkpoint, "f32").model(IDS)
    out = plan(PlanRequest(model=str(fp8_dir), tp=2, precision="f32", weights="fp8"))
    for group, ctxs in (
        (tp2, [ParallelCtx(tp_rank=r, tp_size=2) for r in range(2)]),
        (ep2, [ParallelCtx(ep_rank=r, ep_size=2) for r in range(2)]),
    ):
        stats = group.call("load", checkpoint, "f32", "cpu", "fp8")
        _equal(group.call("logits", IDS)[0], want)
        assert [s["bytes_read"] for s in stats] == [expected_bytes(fp8_dir, ctx) for ctx in ctxs]
    for r, ctx in enumerate([ParallelCtx(tp_rank=r, tp_size=2) for r in range(2)]):
        # each rank's share held (built here without a process group: loading needs none)
        model = load_model(checkpoint, "f32", ctx=ctx, weights="fp8").model
        elements, entries, _ = share_of_quantized(fp8_dir, ctx)
        assert held_fp8_bytes(model) == (elements, entries * 4)
        held = (
            sum(p.numel() * p.element_size() for p in model.parameters()) + held_fp8_bytes(model)[1]
        )
        # ster plan --weights fp8 states what the rank holds
        assert out["ranks"][r]["parameter_bytes"] == held
    ep_rank = ParallelCtx(ep_rank=1, ep_size=2)  # its experts only, each whole
    elements, entries, _ = share_of_quantized(fp8_dir, ep_rank)
    assert held_fp8_bytes(load_model(checkpoint, "f32", ctx=ep_rank, weights="fp8").model) == (
        elements,
        entries * 4,
    )


def test_stacked_fp8_experts_kept_and_split_inside_blocks_under_tp2(checkpoints, tp2):
    fp8_dir = checkpoints["qwen3_moe"] / "stacked" / "fp8"
    assert (
        "model.layers.1.mlp.experts.gate_up_proj_scale_inv"
        in read_header(fp8_dir / "model.safetensors").tensors
    )
    checkpoint = resolve(str(fp8_dir))
    with torch.no_grad():
        want = load_model(checkpoint, "f32").model(IDS)
    stats = tp2.call("load", checkpoint, "f32", "cpu", "fp8")
    _equal(tp2.call("logits", IDS)[0], want)
    ctxs = [ParallelCtx(tp_rank=r, tp_size=2) for r in range(2)]
    assert [s["bytes_read"] for s in stats] == [expected_bytes(fp8_dir, ctx) for ctx in ctxs]
    model = load_model(checkpoint, "f32", ctx=ctxs[1], weights="fp8").model
    assert model.layers[1].mlp.experts.up.dtype == FP8
    elements, entries, _ = share_of_quantized(fp8_dir, ctxs[1])
    assert held_fp8_bytes(model) == (elements, entries * 4)


@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_compressed_tensors_fp8_kept_per_channel_tensor_and_block(tmp_path, tp2, variant):
    """compressed-tensors' three strategies (a scale per row, one per tensor, per block) kept
    alike."""
    from tests.load.test_compressed_fp8 import write_compressed

    make_tiny(variant, tmp_path / "source")
    write_compressed(variant, tmp_path / "source", tmp_path / "ct", tmp_path / "ref")
    checkpoint = resolve(str(tmp_path / "ct"))
    kept = load_model(checkpoint, "f32", weights="fp8")
    assert any(p.dtype == FP8 for p in kept.model.parameters())
    with torch.no_grad():
        want = load_model(checkpoint, "f32").model(IDS)
        _equal(kept.model(IDS), want)
    tp2.call("load", checkpoint, "f32", "cpu", "fp8")
    _equal(tp2.call("logits", IDS)[0], want)


def test_plan_in_dequantize_mode_still_counts_the_compute_dtype(checkpoints):
    fp8_dir = checkpoints["qwen3_moe"] / "fp8"
    kept = plan(PlanRequest(model=str(fp8_dir), precision="f32", weights="fp8"))
    dequantized = plan(PlanRequest(model=str(fp8_dir), precision="f32"))
    model = load_model(resolve(str(fp8_dir)), "f32").model
    assert dequantized["ranks"][0]["parameter_bytes"] == sum(
        p.numel() * p.element_size() for p in model.parameters()
    )
    assert (
        kept["weights"] == "fp8"
        and kept["ranks"][0]["parameter_bytes"] < dequantized["ranks"][0]["parameter_bytes"]
    )
    assert kept["ranks"][0]["read_bytes"] == dequantized["ranks"][0]["read_bytes"]


def test_an_adapter_adds_on_top_of_the_kept_product(checkpoints):
    checkpoint = resolve(str(checkpoints["qwen3_moe"] / "fp8"))
    gen = torch.Generator().manual_seed(3)
    models = [
        load_model(checkpoint, "f32").model,
        load_model(checkpoint, "f32", weights="fp8").model,
    ]
    shapes = {n: p.shape for n, p in models[0].named_parameters()}
    sites = [
        {
            "param": name,
            "a": torch.randn(2, shapes[name][1], generator=gen) * 0.1,
            "b": torch.randn(shapes[name][0], 2, generator=gen) * 0.1,
            "scale": 2.0,
        }
        for name in ("layers.0.attn.q.weight", "layers.1.attn.o.weight", "layers.0.mlp.down.weight")
    ]
    with torch.no_grad():
        before = models[1](IDS)
        for model in models:
            attach(model, sites)
        _equal(models[1](IDS), models[0](IDS))
        # the adapter did change it
        assert compare(models[1](IDS), before)["max_relative_error"] > 1e-3


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_greedy_generation_through_the_engine_agrees(checkpoints, variant):
    fp8_dir = checkpoints[variant] / "fp8"
    args = (
        f"--model={fp8_dir}",
        "--prompt=the quick brown fox",
        "--chat-template=off",
        "--max-new-tokens=8",
        "--ignore-eos",
    )
    want, got = cli_generate(*args), cli_generate(*args, "--weights=fp8")
    assert got["weights"] == "fp8" and "weights" not in want
    assert (
        got["text"] == want["text"] and got["completion_tokens"] == want["completion_tokens"] == 8
    )


def test_fp8_is_refused_without_fp8_weights_and_on_mxfp4(checkpoints, tmp_path):
    ref = checkpoints["qwen3_moe"] / "ref"
    with pytest.raises(
        Refusal,
        match=r"--weights fp8 keeps FP8 weights, but .* has none .*use --weights dequantize",
    ):
        load_model(resolve(str(ref)), "f32", weights="fp8")
    with pytest.raises(Refusal, match=r"--weights fp8 keeps FP8 weights, but .* has none"):
        plan(PlanRequest(model=str(ref), weights="fp8"))
    from ster_dist.config import from_hf
    from ster_dist.load import check_weights

    raw = json.loads((ref / "config.json").read_text())
    cfg = from_hf({**raw, "quantization_config": {"quant_method": "mxfp4"}}, "gpt")
    with pytest.raises(
        Refusal,
        match=r"but gpt is an MXFP4 checkpoint .* loads dequantized only; use --weights "
        "dequantize",
    ):
        check_weights(cfg, "fp8", "gpt")


def test_a_merge_onto_an_fp8_base_is_refused_whatever_the_weights_mode(checkpoints, tmp_path):
    """Chosen: merge refuses an FP8 base in one line (writing FP8 back would mean requantizing);
    merge into a BF16 export, or run the adapter unmerged on the kept FP8 model (test above)."""
    from ster_dist.adapters.merge import prepare

    fp8_dir = checkpoints["qwen3_moe"] / "fp8"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["o_proj"],
                "base_model_name_or_path": str(fp8_dir),
            }
        )
    )
    prefix = "base_model.model.model.layers.0.self_attn.o_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.zeros(2, 64),
            f"{prefix}.lora_B.weight": torch.zeros(48, 2),
        },
        str(adapter / "adapter_model.safetensors"),
    )
    with pytest.raises(Refusal) as refused:
        prepare(str(fp8_dir), str(adapter), tmp_path / "merged")
    assert "\n" not in str(refused.value) and "merge into a BF16 export" in str(refused.value)
    assert not (tmp_path / "merged").exists()
