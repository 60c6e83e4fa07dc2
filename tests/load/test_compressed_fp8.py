"""compressed-tensors FP8 checkpoints (quant_method compressed-tensors, float-quantized) dequantized
while loading.

A tiny llama and a tiny qwen3_moe are quantized here as llm-compressor writes FP8 (per output
channel:
scale [rows, 1]; per tensor: scale [1]; per block: scale [ceil(rows / b0), ceil(cols / b1)]; in
each, scale = amax / 448 and the weight stored as float8_e4m3fn of w / scale, beside
`<module>.weight_scale`),
with config groups mixing strategies, an `ignore` list (the head and the routers) and activation
schemes (dynamic per token on the llama; static with `input_scale` tensors on the MoE). The
reference is the same bytes dequantized here, saved as float32 and run by Transformers: logits
compared at TP=1, TP=2 and (the MoE) EP=2 over real gloo groups, and each rank's bytes read equal
its planned share of the FP8 weights plus the scale entries covering it, and what `ster plan` says
it reads.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ster_dist.config.load import model_config
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.ops.plan import plan
from ster_dist.ops.tools import inspect_model
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import module_shards
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.schema.plan import PlanRequest
from ster_dist.schema.tools import InspectModelRequest
from ster_dist.shard import quantized
from ster_dist.shard.plan import build_plan
from ster_dist.shard.safetensors_header import DTYPES, read_header
from tests.tiny_models import make_tiny

E4M3_MAX = 448.0
IDS = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
# straddles the TP splits (q_proj's rows at 32, an expert's 24 rows at 12) and divides nothing
BLOCK = (24, 20)
IGNORE = ["lm_head", "re:.*mlp\\.gate$"]


def scheme(strategy: str, targets: list[str], activations: dict | None = None) -> dict:
    weights = {
        "num_bits": 8,
        "type": "float",
        "strategy": strategy,
        "symmetric": True,
        "dynamic": False,
        "group_size": None,
        "block_structure": list(BLOCK) if strategy == "block" else None,
    }
    return {
        "targets": targets,
        "weights": weights,
        "input_activations": activations,
        "output_activations": None,
    }


DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
# variant -> (strategy of the attention projections, of the feed-forward ones, activation scheme)
VARIANTS = {"llama": ("channel", "tensor", DYNAMIC), "qwen3_moe": ("channel", "block", STATIC)}


def quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, its scale) for one strategy, as compressed-tensors stores them."""
    rows, cols = w.shape
    w = w.float()
    if strategy == "channel":
        scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
        # stored in the model's dtype
        return (w / scale).to(torch.float8_e4m3fn), scale.to(torch.bfloat16)
    if strategy == "tensor":
        scale = w.abs().amax().clamp_min(1e-12).reshape(1) / E4M3_MAX
        return (w / scale).to(torch.float8_e4m3fn), scale
    b0, b1 = BLOCK
    nr, nc = -(-rows // b0), -(-cols // b1)
    blocks = F.pad(w, (0, nc * b1 - cols, 0, nr * b0 - rows)).reshape(nr, b0, nc, b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).reshape(nr * b0, nc * b1)[:rows, :cols]
    return q.contiguous().to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, strategy: str) -> torch.Tensor:
    if strategy != "block":  # one scale per row, or one for the tensor: broadcast
        return q.float() * scale.float()
    rows, cols = q.shape
    return (
        q.float()
        * scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:rows, :cols]
    )


def strategy_of(name: str, variant: str) -> str | None:
    """Every linear weight but the head and the routers; the attention's in one group, the rest in
    another."""
    if not name.endswith("proj.weight"):
        return None
    attention, feed_forward, _ = VARIANTS[variant]
    return attention if ".self_attn." in name else feed_forward


def write_compressed(variant: str, source: Path, ct_dir: Path, ref_dir: Path) -> None:
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    attention, feed_forward, activations = VARIANTS[variant]
    ct, dequantized = {}, {}
    for name, t in tensors.items():
        strategy = strategy_of(name, variant)
        if strategy is None:
            ct[name] = dequantized[name] = t
            continue
        q, scale = quantize(t, strategy)
        ct[name], ct[name + "_scale"] = q, scale
        dequantized[name] = dequantize(q, scale, strategy)
        # a static activation scale per module, as calibration leaves it
        if not activations["dynamic"]:
            ct[name[: -len("weight")] + "input_scale"] = torch.tensor([0.02])
    quant = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": scheme(attention, ["re:.*self_attn.*"], activations),
            "group_1": scheme(feed_forward, ["re:.*mlp.*"], activations),
        },
        "ignore": IGNORE,
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }
    for directory, weights, cfg in (
        (ct_dir, ct, {**config, "quantization_config": quant}),
        (ref_dir, dequantized, config),
    ):
        directory.mkdir()
        for path in source.iterdir():
            if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
                shutil.copy(path, directory / path.name)
        (directory / "config.json").write_text(json.dumps(cfg))
        save_file(
            {k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors")
        )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (compressed-tensors directory, Transformers on the float32 twin)."""
    import transformers

    out = {}
    for variant in VARIANTS:
        root = tmp_path_factory.mktemp(variant)
        make_tiny(variant, root / "source")
        write_compressed(variant, root / "source", root / "ct", root / "ref")
        out[variant] = (
            root / "ct",
            transformers.AutoModelForCausalLM.from_pretrained(
                root / "ref", dtype=torch.float32
            ).eval(),
        )
    return out


def planned_bytes(directory: Path, ctx: ParallelCtx) -> int:
    """One rank's share: its planned window of every tensor in the stored dtype and, for an FP8
    weight, the scale entries of every block its window touches (a per-tensor scale whole, once per
    window)."""
    checkpoint = resolve(str(directory))
    cfg = model_config(checkpoint)
    stored = {}
    for path in checkpoint.weight_files:
        for name, info in read_header(path).tensors.items():
            stored[name] = (DTYPES[info["dtype"]], tuple(info["shape"]))
    shapes = {n: s for n, (_, s) in stored.items() if not n.endswith(("_scale", "input_scale"))}
    total = 0
    for read in build_plan(cfg.spec, cfg, module_shards(meta_decoder(cfg, ctx)), shapes).reads:
        dtype, shape = stored[read.source]
        for piece in read.pieces:
            window = piece.window or (piece.rows or slice(None), piece.cols or slice(None))
            window = (tuple(window) + (slice(None),) * len(shape))[: len(shape)]
            bounds = [w.indices(n)[:2] for w, n in zip(window, shape, strict=True)]
            total += math.prod(b - a for a, b in bounds) * dtype.itemsize
            if read.source + "_scale" not in stored:
                continue
            scale_dtype, scale_shape = stored[read.source + "_scale"]
            (r0, r1), (c0, c1) = bounds
            if scale_shape == (shape[0], 1):
                entries = r1 - r0
            elif math.prod(scale_shape) == 1:
                entries = 1
            else:
                entries = (-(-r1 // BLOCK[0]) - r0 // BLOCK[0]) * (
                    -(-c1 // BLOCK[1]) - c0 // BLOCK[1]
                )
            total += entries * scale_dtype.itemsize
    return total


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    result = compare(ours, theirs)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.99999, result


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compressed_fp8_loads_dequantized_and_matches_transformers_on_the_same_bytes(
    checkpoints, variant, capfd, monkeypatch
):
    directory, reference = checkpoints[variant]
    monkeypatch.setattr(quantized, "_said", set())
    capfd.readouterr()
    loaded = load_model(resolve(str(directory)), "f32")
    load_model(resolve(str(directory)), "f32")
    note = [line for line in capfd.readouterr().err.splitlines() if "is not applied" in line]
    scheme = "input_activations dynamic" if variant == "llama" else "input_activations static"
    assert (
        len(note) == 1
        and f"compressed-tensors {scheme} quantization is not applied" in note[0]
        and "weight-only" in note[0]
    )
    with torch.no_grad():
        _close(loaded.model(IDS), reference(IDS).logits)
    assert loaded.bytes_read == planned_bytes(directory, ParallelCtx())
    said = plan(PlanRequest(model=str(directory)))
    assert (
        said["quantization"] == "compressed-tensors"
        and said["ranks"][0]["read_bytes"] == loaded.bytes_read
    )
    assert said["activation_scale_tensors"] == (
        0
        if variant == "llama"
        else sum(
            n.endswith("input_scale") for n in read_header(directory / "model.safetensors").tensors
        )
    )
    config = inspect_model(InspectModelRequest(model=str(directory)))["config"]["quantization"]
    attention, feed_forward, _ = VARIANTS[variant]
    assert config["method"] == "compressed-tensors" and config["strategies"] == [
        attention,
        feed_forward,
    ]
    assert config["ignore"] == IGNORE and config["activations_not_applied"] == [scheme]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compressed_fp8_under_tp2_and_ep2_reads_its_share(checkpoints, tp2, ep2, variant):
    directory, reference = checkpoints[variant]
    checkpoint = resolve(str(directory))
    with torch.no_grad():
        theirs = reference(IDS).logits
    runs = [(tp2, 2, 1)] + ([(ep2, 1, 2)] if variant == "qwen3_moe" else [])
    for group, tp, ep in runs:
        stats = group.call("load", checkpoint, "f32", "cpu")
        _close(group.call("logits", IDS)[0], theirs)
        ctxs = [
            ParallelCtx(tp_rank=r % tp, tp_size=tp, ep_rank=r // tp, ep_size=ep) for r in range(2)
        ]
        planned = [planned_bytes(directory, ctx) for ctx in ctxs]
        assert [s["bytes_read"] for s in stats] == planned
        assert [
            r["read_bytes"] for r in plan(PlanRequest(model=str(directory), tp=tp, ep=ep))["ranks"]
        ] == planned


def _with_quant(source: Path, target: Path, **changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **changes}
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    "changes, why",
    [
        (
            {
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "strategy": "group",
                            "group_size": 128,
                            "symmetric": True,
                        },
                    }
                },
            },
            "format pack-quantized (config group group_0)",
        ),
        (
            {
                "format": "int-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 8,
                            "type": "int",
                            "strategy": "channel",
                            "symmetric": True,
                        },
                    }
                },
            },
            "format int-quantized",
        ),
        (
            {
                "format": "naive-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 8,
                            "type": "int",
                            "strategy": "channel",
                            "symmetric": True,
                        },
                    }
                },
            },
            "weights num_bits 8 type int",
        ),
        (
            {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
            "a kv_cache_scheme",
        ),
    ],
)
def test_other_compressed_tensors_schemes_keep_a_one_line_refusal(
    checkpoints, tmp_path, changes, why
):
    directory, _ = checkpoints["llama"]
    other = _with_quant(directory, tmp_path / "other", **changes)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(other)), "f32")
    message = str(refused.value)
    assert "\n" not in message and why in message and "compressed-tensors" in message


def test_a_scale_unlike_every_strategy_is_refused_naming_the_tensor(checkpoints, tmp_path):
    directory, _ = checkpoints["llama"]
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    tensors[name] = torch.ones(3, 2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        Refusal, match=rf"{name} has shape \[3, 2\], which fits none of the config's strategies"
    ):
        load_model(resolve(str(broken)), "f32")


def test_a_quantized_module_the_config_ignores_is_refused(checkpoints, tmp_path):
    directory, _ = checkpoints["llama"]
    wrong = _with_quant(directory, tmp_path / "wrong", ignore=[*IGNORE, "re:.*o_proj$"])
    with pytest.raises(Refusal, match=r"o_proj\.weight is quantized .*quantization_config\.ignore"):
        load_model(resolve(str(wrong)), "f32")
