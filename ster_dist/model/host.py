"""What a step builds on the host and its layers read on the device.

A step's bookkeeping (positions, cache slots, block tables, masks) comes from Python lists and host
tensors, and every decision it takes (whether a mask is needed, which kernel takes attention, how
far the rotary tables reach) reads those host copies: reading a device tensor from the host
(`int(t)`, `bool(t.all())`,
`t.tolist()`)
waits for every kernel queued before it, so the host could not run ahead of the device. Only the
sampled tokens are read back, once a step. What the layers read goes to the device once a step,
through `upload`.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`: itself where it already lies there (the CPU); on CUDA copied
    from pinned memory without blocking (a copy from pageable memory waits for the stream's queued
    kernels: a sync each step)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
