"""MXFP4 weights read as plain ones: a TensorSource over a checkpoint's source that presents each
packed pair `X_blocks` / `X_scales` as the tensor X, dequantized window by window.

gpt-oss stores each expert matrix outputs-first and quantized along its inputs: X_blocks is uint8
[experts, rows, groups, 16], two e2m1 values a byte (the low nibble first), 32 values a group, and
X_scales is uint8 [experts, rows, groups], one e8m0 exponent a group (2 ** (s - 127)). Transformers'
dequantizer (integrations/mxfp4.py, convert_moe_packed_tensors) hands X on inputs-first, [experts,
groups * 32, rows], the layout the gpt_oss name map reads, so X is presented in that shape. A window
of X reads only the bytes and exponents of its experts, rows and groups; a window that starts or
ends inside a 32-value group is refused naming --tp (check_window), since no split of whole ranks'
inputs would need it.
"""

from __future__ import annotations

import torch

from ster_dist.config.quant import Mxfp4
from ster_dist.errors import Refusal
from ster_dist.shard import loader
from ster_dist.shard.source import TensorSource

BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32  # values per e8m0 exponent
GROUP_BYTES = 16  # two e2m1 values a byte
E8M0_BIAS = 127
# e2m1 by its 4-bit code: sign bit 8, then exponent and mantissa
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def packed_pairs(
    shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]
) -> dict[str, tuple[str, str]]:
    """Presented name -> (its blocks tensor, its scales tensor); refuses a half pair or a shape
    unlike gpt-oss's.
    `dtypes` are the safetensors tags (U8 for both halves)."""
    pairs = {}
    for name in sorted(shapes):
        if name.endswith(SCALES) and name[: -len(SCALES)] + BLOCKS not in shapes:
            raise Refusal(
                f"checkpoint tensor {name} has no {name[: -len(SCALES)] + BLOCKS} beside it; the MXFP4 "
                "checkpoint is incomplete"
            )
        if not name.endswith(BLOCKS):
            continue
        base = name[: -len(BLOCKS)]
        scales = base + SCALES
        if scales not in shapes:
            raise Refusal(
                f"checkpoint tensor {name} has no {scales} beside it; the MXFP4 checkpoint is incomplete"
            )
        if base in shapes:
            raise Refusal(
                f"checkpoint tensor {base} is stored both plain and as MXFP4 {name}; remove one"
            )
        blocks, exps = tuple(shapes[name]), tuple(shapes[scales])
        if dtypes[name] != "U8" or dtypes[scales] != "U8":
            raise Refusal(
                f"checkpoint tensors {name} and {scales} are {dtypes[name]} and {dtypes[scales]}, not "
                "U8; the checkpoint is not MXFP4"
            )
        if len(blocks) != 4 or blocks[-1] != GROUP_BYTES or exps != blocks[:-1]:
            raise Refusal(
                f"checkpoint tensors {name} {list(blocks)} and {scales} {list(exps)} are not MXFP4 "
                f"experts ([experts, rows, groups, {GROUP_BYTES}] beside [experts, rows, groups])"
            )
        pairs[base] = (name, scales)
    return pairs


def presented_shape(blocks_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """X's shape as Transformers dequantizes it: [experts, inputs, rows]."""
    experts, rows, groups, _ = blocks_shape
    return experts, groups * GROUP, rows


def check_window(name: str, inputs: int, start: int, stop: int) -> tuple[int, int]:
    """The groups covering inputs start:stop of X; refused when the window cuts inside a group."""
    if start % GROUP or stop % GROUP:
        raise Refusal(
            f"this rank's inputs {start}:{stop} of MXFP4 tensor {name} ({inputs} inputs) cut inside its "
            f"{GROUP}-value blocks; use a --tp that gives every rank whole blocks (one dividing "
            f"{inputs // GROUP})"
        )
    return start // GROUP, stop // GROUP


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., groups, 16] bytes and [..., groups] exponents -> float32 [..., groups * 32]."""
    codes = (
        torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], GROUP).long()
    )
    values = E2M1[codes] * torch.exp2(scales.float() - E8M0_BIAS).unsqueeze(-1)
    return values.reshape(*values.shape[:-2], -1)


class Mxfp4Source:
    """`inner`'s tensors with each MXFP4 pair presented as one tensor, dequantized to `dtype` as it
    is read."""

    def __init__(self, inner: TensorSource, quant: Mxfp4, dtype: torch.dtype):
        self.inner, self.dtype_out = inner, dtype
        names = inner.names()
        tags = {n: "U8" if inner.dtype(n) == torch.uint8 else str(inner.dtype(n)) for n in names}
        self.pairs = packed_pairs({n: tuple(inner.shape(n)) for n in names}, tags)
        for base in self.pairs:
            if not quant.converts(base):
                raise Refusal(
                    f"checkpoint tensor {base} is MXFP4 but its module is in quantization_config."
                    "modules_to_not_convert; the config and the weights disagree"
                )

    # -- TensorSource ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        packed = {n for pair in self.pairs.values() for n in pair}
        return [n for n in self.inner.names() if n not in packed] + list(self.pairs)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.pairs:
            return presented_shape(tuple(self.inner.shape(self.pairs[name][0])))
        return self.inner.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.dtype_out if name in self.pairs else self.inner.dtype(name)

    @property
    def bytes_read(self) -> int:
        return getattr(self.inner, "bytes_read", 0)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if name not in self.pairs:
            return self.inner.read(name, rows, cols)
        return self.read_window(name, (rows or slice(None), cols or slice(None), slice(None)))

    def read_into(
        self, name: str, out: torch.Tensor, rows: slice | None = None, cols: slice | None = None
    ) -> bool:
        if name in self.pairs or not hasattr(self.inner, "read_into"):
            return False
        return self.inner.read_into(name, out, rows, cols)

    def read_window(self, name: str, window: tuple[slice, ...]) -> torch.Tensor:
        """A block of the tensor, [experts, inputs, rows] as presented; dequantized when it is
        packed."""
        if name not in self.pairs:
            return loader.read_window(self.inner, name, window)
        shape = self.shape(name)
        window = tuple(window) + (slice(None),) * (3 - len(window))
        (e0, e1), (q0, q1), (p0, p1) = [
            w.indices(n)[:2] for w, n in zip(window, shape, strict=True)
        ]
        if min(e1 - e0, q1 - q0, p1 - p0) <= 0:
            return torch.empty(
                max(0, e1 - e0), max(0, q1 - q0), max(0, p1 - p0), dtype=self.dtype_out
            )
        g0, g1 = check_window(name, shape[1], q0, q1)
        blocks_name, scales_name = self.pairs[name]
        stored = (slice(e0, e1), slice(p0, p1), slice(g0, g1))
        blocks = loader.read_window(self.inner, blocks_name, stored)
        scales = loader.read_window(self.inner, scales_name, stored)
        return dequantize(blocks, scales).transpose(-1, -2).to(self.dtype_out)

    def close(self) -> None:
        self.inner.close()
