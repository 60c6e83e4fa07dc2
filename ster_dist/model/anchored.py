"""Anchored: a module whose dtype and device are those of an empty buffer moved and cast with it, so
they are known whichever of its parameters this rank holds (a pipeline stage without the embedding,
an MTP draft that borrows the decoder's)."""

from __future__ import annotations

import torch
from torch import nn


class Anchored(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("anchor", torch.empty(0), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype this module's weights are held in."""
        return self.anchor.dtype

    @property
    def device(self) -> torch.device:
        return self.anchor.device
