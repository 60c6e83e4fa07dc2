"""The source a quantized checkpoint is read through: its quantization's dequantizing TensorSource
around the file source, and the one note that activation schemes are not applied.
"""

from __future__ import annotations

import torch

from ster_dist.config.quant import CompressedFP8, Mxfp4, Quantization
from ster_dist.events import progress
from ster_dist.shard.fp8 import Fp8Source
from ster_dist.shard.mxfp4 import Mxfp4Source
from ster_dist.shard.source import TensorSource

_said: set[str] = set()  # notes already given by this process


def dequantizing(source: TensorSource, quant: Quantization, dtype: torch.dtype) -> TensorSource:
    """`source` with `quant`'s quantized tensors dequantized to `dtype` as they are read."""
    if isinstance(quant, Mxfp4):
        return Mxfp4Source(source, quant, dtype)
    if isinstance(quant, CompressedFP8) and quant.activations:
        note = (
            f"compressed-tensors {', '.join(quant.activations)} quantization is not applied: the weights load "
            f"dequantized to {str(dtype).removeprefix('torch.')} and run weight-only"
        )
        if note not in _said:
            _said.add(note)
            progress(note)
    return Fp8Source(source, quant, dtype)
