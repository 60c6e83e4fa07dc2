"""FP8 weights read as plain ones: a TensorSource over a checkpoint's source that dequantizes each
window it is asked for. Two layouts: block-scaled FP8 (quant_method fp8: `W_scale_inv` beside W) and
compressed-tensors FP8 (`W_scale` beside W, per output channel, per tensor or per block).

A quantized tensor W (float8_e4m3fn, [..., rows, cols]) has a companion scale S ([..., ceil(rows /
b0), ceil(cols / b1)]): the value at (r, c) is W[r, c] times S at block (r // b0, c // b1). Block
FP8 states (b0, b1) in its config; a compressed-tensors scale's shape says its strategy: [rows, 1]
per channel (b = (1, cols)), one entry per tensor (b = (rows, cols)), else the config's
block_structure. A window of W is read as its own FP8 bytes plus the scale entries of the blocks
that cover it (a window starting or ending inside a block reads that block's scale), so a rank reads
its share of the weights and of the scales and nothing more. The companions are consumed here: the
name map never sees them. Which tensors are quantized is what the files say (a companion beside it),
as in the published checkpoints, whose norms, embeddings, routers and head stay BF16.
compressed-tensors' activation scales (`input_scale`) are set aside: activation schemes are not
applied (shard/quantized.py says so once).

Under `--weights fp8` the loader reads the tensors it keeps through `read_kept` instead: the same
window's FP8 bytes and covering scale entries, as stored (shard/fp8_kept.py places them).
"""

from __future__ import annotations

import math

import torch

from ster_dist.config.quant import BlockFP8, CompressedFP8
from ster_dist.errors import Refusal
from ster_dist.shard import loader
from ster_dist.shard.source import TensorSource

SCALE = "_scale_inv"
FP8 = torch.float8_e4m3fn
# compressed-tensors' static activation scales
ACTIVATION_SCALES = (".input_scale", ".output_scale")


def scale_block(
    quant: BlockFP8 | CompressedFP8, name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]
) -> tuple[int, int]:
    """The (rows, cols) block one scale entry of `name` covers; refuses a scale whose shape fits no
    strategy."""
    scale = name + quant.scale_suffix
    if len(shape) < 2:
        raise Refusal(
            f"checkpoint tensor {name} of shape {list(shape)} has {scale}, but blocks scale matrices "
            "only"
        )
    rows, cols = shape[-2:]
    if isinstance(quant, BlockFP8):
        block = quant.block
        blocked = (*shape[:-2], *(-(-n // b) for n, b in zip(shape[-2:], block)))
        if tuple(scale_shape) != blocked:
            raise Refusal(
                f"checkpoint tensor {scale} has shape {list(scale_shape)} but {name} {list(shape)} in "
                f"blocks of {list(block)} needs {list(blocked)}; the weight_block_size and the weights "
                "disagree"
            )
        return block
    lead = tuple(shape[:-2])
    if "tensor" in quant.strategies and math.prod(scale_shape) == math.prod(lead):
        return rows, cols
    if "channel" in quant.strategies and tuple(scale_shape) == (*lead, rows, 1):
        return 1, cols
    if quant.block and tuple(scale_shape) == (
        *lead,
        *(-(-n // b) for n, b in zip((rows, cols), quant.block)),
    ):
        return quant.block
    raise Refusal(
        f"checkpoint tensor {scale} has shape {list(scale_shape)}, which fits none of the config's "
        f"strategies ({', '.join(quant.strategies)}) for {name} {list(shape)}; the quantization_config "
        "and the weights disagree"
    )


class Fp8Source:
    """`inner`'s tensors with each quantized one dequantized to `dtype` as it is read."""

    def __init__(self, inner: TensorSource, quant: BlockFP8 | CompressedFP8, dtype: torch.dtype):
        self.inner, self.dtype_out = inner, dtype
        suffix = quant.scale_suffix
        names = set(inner.names())
        self.scales: dict[str, str] = {}  # quantized tensor -> its scale tensor
        # quantized tensor -> the block one scale entry covers
        self.blocks: dict[str, tuple[int, int]] = {}
        self.hidden: set[str] = set()  # activation scales, never loaded
        for name in sorted(names):
            scale = name + suffix
            stored = inner.dtype(name)
            if (
                isinstance(quant, CompressedFP8)
                and quant.activations
                and name.endswith(ACTIVATION_SCALES)
            ):
                self.hidden.add(name)
                continue
            if name.endswith(suffix):
                if name[: -len(suffix)] not in names:
                    raise Refusal(
                        f"checkpoint tensor {name} scales no tensor (there is no {name[: -len(suffix)]}); "
                        "the checkpoint is incomplete"
                    )
                continue
            if scale not in names:
                if stored in (torch.float8_e4m3fn, torch.float8_e5m2):
                    raise Refusal(
                        f"checkpoint tensor {name} is stored as {stored} without {scale}; an FP8 "
                        "checkpoint scales every quantized weight"
                    )
                continue
            if not quant.converts(name):
                listed = "ignore" if isinstance(quant, CompressedFP8) else "modules_to_not_convert"
                raise Refusal(
                    f"checkpoint tensor {name} is quantized (it has {scale}) but its module is in "
                    f"quantization_config.{listed}; the config and the weights disagree"
                )
            if stored != FP8:
                raise Refusal(
                    f"checkpoint tensor {name} has {scale} but is stored as {stored}, not float8_e4m3fn; "
                    "the checkpoint is not FP8 e4m3"
                )
            self.blocks[name] = scale_block(
                quant, name, tuple(inner.shape(name)), tuple(inner.shape(scale))
            )
            self.scales[name] = scale

    # -- TensorSource ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        hidden = set(self.scales.values()) | self.hidden
        return [n for n in self.inner.names() if n not in hidden]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.dtype_out if name in self.scales else self.inner.dtype(name)

    @property
    def bytes_read(self) -> int:
        return getattr(self.inner, "bytes_read", 0)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if name not in self.scales:
            return self.inner.read(name, rows, cols)
        shape = self.inner.shape(name)
        window = (rows or slice(None), cols or slice(None), *(slice(None),) * (len(shape) - 2))
        return self.read_window(name, window)

    def read_into(
        self, name: str, out: torch.Tensor, rows: slice | None = None, cols: slice | None = None
    ) -> bool:
        if name in self.scales or not hasattr(self.inner, "read_into"):
            return False
        return self.inner.read_into(name, out, rows, cols)

    def read_kept(self, name: str, window: tuple[slice, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """A window of quantized tensor `name` as stored: its FP8 values, and the scale entries of
        the blocks covering it [..., block rows, block cols] in float32."""
        values, scale, _ = self._window(name, window)
        return values, scale

    def read_window(self, name: str, window: tuple[slice, ...]) -> torch.Tensor:
        """A block of the tensor (one slice per dimension), dequantized when it is quantized."""
        if name not in self.scales:
            return loader.read_window(self.inner, name, window)
        values, scale, (r0, r1, c0, c1, s_rows, s_cols) = self._window(name, window)
        if values.numel() == 0:
            return values.to(self.dtype_out)
        b0, b1 = self.blocks[name]
        # each scale entry spread over its block, then cut to the window's offset inside its first
        # block
        scale = scale.repeat_interleave(b0, -2).repeat_interleave(b1, -1)
        scale = scale[
            ...,
            r0 - s_rows.start * b0 : r1 - s_rows.start * b0,
            c0 - s_cols.start * b1 : c1 - s_cols.start * b1,
        ]
        return (values.float() * scale).to(self.dtype_out)

    def _window(self, name: str, window: tuple[slice, ...]):
        shape = self.inner.shape(name)
        window = tuple(window) + (slice(None),) * (len(shape) - len(window))
        bounds = [w.indices(n)[:2] for w, n in zip(window, shape, strict=True)]
        (r0, r1), (c0, c1) = bounds[-2:]
        values = loader.read_window(self.inner, name, window)
        b0, b1 = self.blocks[name]
        s_rows, s_cols = slice(r0 // b0, -(-r1 // b0)), slice(c0 // b1, -(-c1 // b1))
        scale_name = self.scales[name]
        if values.numel() == 0:
            return values, None, (r0, r1, c0, c1, s_rows, s_cols)
        # one scale per tensor, stored as [] or [1]
        if len(self.inner.shape(scale_name)) < len(shape):
            scale = self.inner.read(scale_name).float().reshape(*values.shape[:-2], 1, 1)
        else:
            scale = loader.read_window(
                self.inner, scale_name, (*window[:-2], s_rows, s_cols)
            ).float()
        return values, scale, (r0, r1, c0, c1, s_rows, s_cols)

    def close(self) -> None:
        self.inner.close()
