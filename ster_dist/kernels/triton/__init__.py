"""Triton kernels: the GPU path's attention, experts and FP8 products, each equal to a torch
reference.

- `decode.paged_decode` (decode.py): one query per sequence over its keys in a paged cache, split
  over the key axis in two stages (SGLang's decode_attention.py, FlashDecoding): GQA, sliding
  window, soft cap, sinks.
- `extend.paged_extend` (extend.py): a chunk's queries over its cached prefix and its own keys,
  causal.
- `moe.fused_experts` (moe.py): tokens sorted by expert and padded to the block size, gate/up with
  SwiGLU in one kernel, down with the router weights in another (vLLM's and SGLang's fused_moe);
  bf16/f32 or FP8 weights in [128, 128] blocks.
- `fp8.quantize_groups`, `fp8.block_gemm` (fp8.py): the per-token-group activation quantizer and the
  block-scaled FP8 product of DeepSeek's recipe.

Triton is imported only when a kernel is asked for (`load()`): where it is missing, `--kernels
triton` is refused in one line. The kernels run on CUDA tensors; on a CPU only under Triton's
interpreter (TRITON_INTERPRET=1, set before the kernel modules are imported), which is how the tests
check them here - slowly, on small shapes.

Two things the interpreter does differently from a GPU, worked around here so one code path serves
both: its
`tl.dot` of bf16 tiles and its f32 -> bf16/fp8 casts are wrong (numpy has no bf16: products come out
garbage and casts truncate instead of rounding). So dots upcast their tiles to f32 where `UPCAST`
(the interpreter, or f32 inputs: exact "ieee" products, as torch's f32 reference), outputs are
compared with a bf16 ulp of tolerance, and the FP8 quantizer rounds to FP8's grid itself before its
(then exact) cast.
"""

from __future__ import annotations

import importlib.util
import os

from ster_dist.errors import Refusal


def installed() -> bool:
    """Whether the triton package can be imported (it is an optional dependency: `pip install
    triton`)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (on CPU tensors): TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable(device_type: str) -> bool:
    """Whether the kernels can run on tensors of this device type: CUDA, or any under the
    interpreter."""
    return installed() and (device_type == "cuda" or (interpreting() and device_type == "cpu"))


def refuse_unless_usable(device_type: str) -> None:
    """One line saying why `--kernels triton` cannot run here, where it cannot."""
    if not installed():
        raise Refusal(
            "--kernels triton needs the triton package (pip install 'triton>=3.4'); "
            "or pick --kernels native or torch"
        )
    if not usable(device_type):
        raise Refusal(
            f"--kernels triton runs on CUDA, not on {device_type} (on a CPU only under "
            "TRITON_INTERPRET=1, slowly, for checks); pick --kernels native or torch"
        )
