"""The depthwise causal convolution that Mamba, Mamba-2, gated delta nets and LFM2's short
convolution run over their channels, continued across steps by a state of the last kernel - 1
inputs.

Each channel has its own kernel, so tensor parallelism splits it by channel with nothing to
exchange:
a rank passes its own channels' inputs, kernels and state."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y [n, t, channels] and the new state for inputs x [n, t, channels], kernels weight [channels,
    kernel] (Transformers stores [channels, 1, kernel]: pass it flattened), bias [channels] and
    state [n, channels, kernel - 1], the inputs before x (zeros for a fresh sequence). Tokens where
    valid [n, t] is False are left padding: their inputs count as zeros, as a fresh sequence's past
    does."""
    if valid is not None:
        x = x * valid.unsqueeze(-1).to(x.dtype)
    kernel = weight.shape[1]
    # [n, channels, kernel - 1 + t]
    window = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=2)
    y = F.conv1d(window, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return y.transpose(1, 2), window[:, :, window.shape[2] - (kernel - 1) :]
