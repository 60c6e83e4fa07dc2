"""DeepSeek-V4's window compressor: every `rate` consecutive positions (from a sequence's first
token) become one compressed entry.

Per token, kv_proj(x) and gate_proj(x); an entry is kv_norm(sum over its window of kv * softmax(gate
+
position_bias)), the softmax per channel over the window's tokens in f32, then its trailing rotated
channels turn at the window's first position. With `overlap` (the compressed sparse attention
layers) each token projects two series, Ca (the first `width` channels) and Cb (the rest): entry w
mixes window w-1's Ca with window w's Cb over 2 * rate slots, so it reaches back one window (entry 0
has nothing before it).

The compressor keeps no state of its own: each token's raw projections (`project`) ride in the
attention layer's cache slot, so both caches keep them, and `entries` rebuilds the entries from
them, laid out by position, at every step (as the pooled indexer rebuilds its pools,
model/pooled_indexer.py). A decode step therefore sees the tail past the last whole window, every
entry made so far and the last window's Ca exactly as the same text read whole does. The compressor
is small and held whole on every rank.
"""

from __future__ import annotations

import torch

from ster_dist.model.norm import Norm
from ster_dist.model.rope import apply_rotary
from ster_dist.parallel.linear import ColumnLinear, Replicated


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, width] with its last 2 * cos.shape[-1] channels turned by adjacent
    pairs (DeepSeek-V4 lays each head out as [unrotated | rotated]); in f32, as Transformers turns
    them."""
    rot = cos.shape[-1] * 2
    turned = apply_rotary(x[..., -rot:].float(), cos.float(), sin.float(), True).to(x.dtype)
    return torch.cat((x[..., :-rot], turned), dim=-1)


def by_position(
    values: torch.Tensor, key_pos: torch.Tensor, real: torch.Tensor, span: int
) -> torch.Tensor:
    """[n, span, width]: each real key's values [n, 1, keys, width] at its position (positions past
    span dropped, unfilled ones zero), so windows follow positions: the static cache's left padding
    and the paged cache's unused slots never join one."""
    n, _, _, width = values.shape
    slot = key_pos.masked_fill(~real | (key_pos >= span), span)
    out = values.new_zeros(n, span + 1, width)
    out.scatter_(1, slot.unsqueeze(-1).expand(-1, -1, width), values[:, 0])
    return out[:, :span]


class WindowCompressor(torch.nn.Module):
    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        series = 2 * width if overlap else width
        self.kv = ColumnLinear(hidden, series, ((0, series),), False)
        self.gate = ColumnLinear(hidden, series, ((0, series),), False)
        self.position_bias = Replicated((rate, series))
        self.kv_norm = Norm(width, eps, scale_f32=True)
        self.cache_width = 2 * series  # a token's kv then its gate logits

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, 1, seq, cache_width]: what each token keeps in the cache for the compressor."""
        return torch.cat((self.kv(x), self.gate(x)), dim=-1).unsqueeze(1)

    def entries(
        self, raw: torch.Tensor, windows: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """[n, windows, width]: the entries of whole windows from raw [n, windows * rate,
        cache_width] laid out by position; cos, sin [n, windows, rotated / 2] at each window's first
        position."""
        n, r = raw.shape[0], self.rate
        kv, gate = raw.view(n, windows, r, self.cache_width).split(self.cache_width // 2, dim=-1)
        gate = gate.float() + self.position_bias.weight.float()
        if self.overlap:  # Ca of the window before (none before the first), then this window's Cb
            d = self.width
            before_kv = torch.cat((kv.new_zeros(n, 1, r, d), kv[:, :-1, :, :d]), dim=1)
            before_gate = torch.cat(
                (gate.new_full((n, 1, r, d), float("-inf")), gate[:, :-1, :, :d]), dim=1
            )
            kv = torch.cat((before_kv, kv[..., d:]), dim=2)
            gate = torch.cat((before_gate, gate[..., d:]), dim=2)
        weights = gate.softmax(dim=2).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=2))
        return rotate_tail(entries.unsqueeze(1), cos, sin).squeeze(1)
