"""Loading a model on one rank: ModelConfig -> the decoder built on the meta device -> filled from
its weight source by the streaming loader (shard/loader.py), plus the checks that come first
(device, precision, expert-parallel split, the weights mode).

`--weights dequantize` (the default) holds an FP8 checkpoint's weights dequantized to --precision;
`--weights fp8` keeps its projections and experts in FP8 beside their block scales
(shard/fp8_kept.py);
`--weights blocks` keeps a .gguf's Q8_0/Q4_0/Q4_1 weights in their blocks on the CPU
(shard/ggml_kept.py).

The same steps run in every tensor-parallel rank with that rank's ParallelCtx;
resolution (and any download) happens once, in the driver, before ranks start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ster_dist.checkpoint import Checkpoint
from ster_dist.config import ModelConfig
from ster_dist.config.load import model_config
from ster_dist.config.quant import Mxfp4
from ster_dist.errors import Refusal
from ster_dist.model.decoder import Decoder, meta_decoder
from ster_dist.parallel.ctx import SINGLE, ParallelCtx
from ster_dist.shard.loader import fill_module
from ster_dist.shard.quantized import dequantizing
from ster_dist.shard.source import SafetensorsSource, TensorSource

PRECISIONS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
WEIGHTS = ("dequantize", "fp8", "blocks")


def compute_dtype(precision: str, device: str) -> torch.dtype:
    """The dtype weights are held and multiplied in. f16 products on CPU run about 300x slower
    than f32 (measured), so f16 computes in f32 on the CPU."""
    if precision not in PRECISIONS:
        raise Refusal(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "f16" and device == "cpu":
        return torch.float32
    return PRECISIONS[precision]


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    if device == "cuda":
        if not torch.cuda.is_available():
            raise Refusal(
                "--device cuda was requested but this torch build sees no CUDA device; use --device cpu"
            )
        return device
    raise Refusal(f"--device {device!r} is not one of cpu, cuda")


def check_expert_parallel(cfg: ModelConfig, ctx: ParallelCtx) -> None:
    """--ep splits experts: refused, before any weight is read, where there are none or too few."""
    if ctx.ep_size == 1:
        return
    if cfg.moe is None:
        raise Refusal(
            f"--ep {ctx.ep_size} splits experts, but {cfg.family} is not a mixture-of-experts model; "
            "use --tp to split it"
        )
    if ctx.ep_size > cfg.moe.num_experts:
        raise Refusal(
            f"--ep {ctx.ep_size} is more than the model's {cfg.moe.num_experts} experts; "
            f"use at most --ep {cfg.moe.num_experts}"
        )


def check_weights(
    cfg: ModelConfig,
    weights: str,
    model: str,
    weight_format: str | None = None,
    device: str = "cpu",
) -> None:
    """--weights fp8 needs FP8 weights to keep, --weights blocks a .gguf on the CPU: refused, before
    any weight is read, on anything else (a format not known yet, as ster plan's, is not
    checked)."""
    if weights not in WEIGHTS:
        raise Refusal(f"--weights {weights!r} is not one of {', '.join(WEIGHTS)}")
    if weights == "dequantize":
        return
    if weights == "blocks":
        if weight_format not in (None, "gguf"):
            raise Refusal(
                f"--weights blocks keeps a .gguf's Q8_0/Q4_0/Q4_1 blocks, but {model} holds "
                f"{weight_format} weights; use --weights dequantize"
            )
        if str(device) != "cpu":
            raise Refusal(
                f"--weights blocks runs on the CPU only (kernels/blocks.cpp), not {device}; use "
                "--weights dequantize"
            )
        return
    if cfg.quant is None:
        raise Refusal(
            f"--weights fp8 keeps FP8 weights, but {model} has none (its config states no FP8 "
            "quantization); use --weights dequantize"
        )
    if isinstance(cfg.quant, Mxfp4):
        raise Refusal(
            f"--weights fp8 keeps FP8 weights, but {model} is {cfg.quant.describe()}, which loads "
            "dequantized only; use --weights dequantize"
        )


def open_source(
    checkpoint: Checkpoint, dtype: torch.dtype, cfg: ModelConfig | None = None
) -> TensorSource:
    """The checkpoint's tensors; quantized ones (cfg.quant: FP8, MXFP4) dequantized to `dtype` as
    read."""
    # Mistral's consolidated files are safetensors
    if checkpoint.weight_format in ("safetensors", "mistral"):
        source = SafetensorsSource(checkpoint.weight_files)
        if cfg is not None and cfg.quant is not None:
            try:
                return dequantizing(source, cfg.quant, dtype)
            except Refusal:
                source.close()
                raise
        return source
    if checkpoint.weight_format == "gguf":
        from ster_dist.gguf.source import GGUFSource

        return GGUFSource(checkpoint.weight_files[0], checkpoint.raw_config, dtype)
    raise Refusal(
        f"weights in {checkpoint.weight_format} format are not loadable by this ster_dist build yet; "
        "use a checkpoint in Transformers' safetensors layout"
    )


def load_decoder(
    cfg: ModelConfig,
    source: TensorSource,
    ctx: ParallelCtx = SINGLE,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    keep_fp8: bool = False,
    keep_blocks: bool = False,
) -> Decoder:
    """This rank's decoder, built on the meta device and filled from `source`, in eval mode."""
    model = meta_decoder(cfg, ctx, dtype)
    fill_module(model, cfg, source, device, keep_fp8, keep_blocks=keep_blocks)
    model.fuse_projections()
    return model.eval()


@dataclass
class LoadedModel:
    checkpoint: Checkpoint
    cfg: ModelConfig
    model: Decoder
    precision: str
    device: str
    bytes_read: int = 0  # bytes this rank read from the weight files
    weights: str = "dequantize"


def load_model(
    checkpoint: Checkpoint,
    precision: str = "f32",
    device: str = "cpu",
    ctx: ParallelCtx = SINGLE,
    weights: str = "dequantize",
) -> LoadedModel:
    device = check_device(device)
    dtype = compute_dtype(precision, device)
    cfg = model_config(checkpoint)
    check_expert_parallel(cfg, ctx)
    check_weights(cfg, weights, checkpoint.model, checkpoint.weight_format, device)
    source = open_source(checkpoint, dtype, cfg)
    try:
        # --weights blocks: a .gguf's Q8_0/Q4_0/Q4_1 weights run as stored on the CPU
        # (kernels/blocks.cpp);
        # opt-in while that kernel is slower here than the dequantized f32/bf16 products (issue 62)
        model = load_decoder(
            cfg,
            source,
            ctx,
            dtype,
            device,
            keep_fp8=weights == "fp8",
            keep_blocks=weights == "blocks",
        )
        bytes_read = getattr(source, "bytes_read", 0)
    finally:
        source.close()
    return LoadedModel(checkpoint, cfg, model, precision, device, bytes_read, weights)
