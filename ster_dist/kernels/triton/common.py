"""What the Triton kernels share: the dot that works under the interpreter and on a GPU alike, tanh,
and the checks every entry point makes of its tensors before a launch (refused by name, never read
as garbage)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ster_dist.kernels.triton import interpreting

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in f32. UPCAST: both tiles in f32 first, multiplied exactly ("ieee", not
    TF32) - what f32 inputs need to equal torch's f32 products, and what the interpreter needs for
    bf16 (its bf16 dot is wrong); otherwise the tiles' own dtype on the tensor cores."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def tanh(x):
    # tl has no tanh the interpreter runs; 2 sigmoid(2x) - 1 is it, without overflow for large |x|
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


def upcast(*tensors: torch.Tensor) -> bool:
    """The UPCAST of `dot` for tiles of these tensors: under the interpreter, or where any is
    f32."""
    return interpreting() or any(t.dtype == torch.float32 for t in tensors)


def pow2(n: int, least: int = 16) -> int:
    """The power of two a tile of n elements is padded to (at least `least`: tl.dot's smallest
    side)."""
    return max(least, triton.next_power_of_2(n))


def check(name: str, tensor: torch.Tensor, dims: int, dtypes=FLOATS) -> None:
    """Refuse `tensor` unless it has `dims` dimensions, one of `dtypes` and contiguous
    last-dimension elements."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name}: a {dims}-dimensional tensor expected, got {got}")
    if tensor.dtype not in dtypes:
        raise ValueError(
            f"{name}: dtype {tensor.dtype} is not one of {', '.join(map(str, dtypes))}"
        )
    if tensor.numel() and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name}: its last dimension must be contiguous (stride {tensor.stride(-1)})"
        )
