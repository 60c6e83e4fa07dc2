"""Hyper-connections: a residual of several streams (DeepSeek-V4, GLM-5-Next, HY V4's independent
form).

The residual is hyper_streams copies of the hidden state, [..., streams, hidden]. Before each
sublayer a hyper-connection reads the streams flattened and RMS-normed without a scale, and one
small product (`fn`, then `scale` and `base` per part) yields:

- pre: sigmoid(.) + eps per stream, which collapses the streams into the sublayer's input;
- post: post_scale * sigmoid(.) (+ eps in HY V4's form), which spreads the sublayer's output over
  the streams;
- comb (mixing form only): a softmax per row made doubly stochastic by hyper_sinkhorn_iters
  Sinkhorn-Knopp rounds, which mixes the incoming streams into the outgoing ones (HY V4's
  independent form has none: each stream keeps itself).

After the last layer the streams become one hidden state again before the final norm: through the
head's own pre weights (hc_head) or as their plain mean (GLM-5-Next). Capture and steering see one
hidden state per token: a hook reads the streams' mean, and what it adds to that mean is added to
every stream (model/decoder.py). Everything here is token-wise, so cached, paged and whole reads
agree; the weights are small and held whole on every rank. The weights are computed in f32, as the
releases compute them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import ModelConfig
from ster_dist.parallel.ctx import Shard
from ster_dist.parallel.linear import ShardedModule


def _inverse_rms(flat: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def _collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


class HyperConnection(ShardedModule):
    """The weights before one sublayer: `forward` collapses the streams, `join` adds the output
    back."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw, n = cfg.raw, cfg.hyper_streams
        self.streams, self.eps, self.norm_eps = n, float(raw["hyper_eps"]), cfg.norm_eps
        self.mixing = bool(raw["hyper_mixing"])
        self.post_scale, self.post_eps = (
            float(raw["hyper_post_scale"]),
            float(raw["hyper_post_eps"]),
        )
        self.sinkhorn_iters = int(raw.get("hyper_sinkhorn_iters") or 0)
        parts = (2 + n) * n if self.mixing else 2 * n
        self._param("fn", Shard((parts, n * cfg.hidden_size)))
        self._param("base", Shard((parts,)))
        self._param("scale", Shard((3 if self.mixing else 2,)))

    def forward(
        self, streams: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]:
        """The sublayer's input [..., hidden] and the weights `join` needs."""
        n = self.streams
        flat = streams.flatten(-2).float()
        mixes = F.linear(flat, self.fn.float()) * _inverse_rms(flat, self.norm_eps)
        sizes = [n, n, n * n] if self.mixing else [n, n]
        logits, bases, scales = (
            mixes.split(sizes, dim=-1),
            self.base.float().split(sizes),
            self.scale.float(),
        )
        pre = torch.sigmoid(logits[0] * scales[0] + bases[0]) + self.eps
        post = self.post_scale * torch.sigmoid(logits[1] * scales[1] + bases[1]) + self.post_eps
        comb = self._comb(logits[2] * scales[2] + bases[2]) if self.mixing else None
        return _collapse(streams, pre), (post, comb)

    def _comb(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., n, n]: row softmax, then columns and rows normalised in turn (Sinkhorn-Knopp)."""
        n = self.streams
        comb = torch.softmax(logits.unflatten(-1, (n, n)), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return comb

    def join(self, streams: torch.Tensor, out: torch.Tensor, weights) -> torch.Tensor:
        """The outgoing streams: the sublayer's output `out` [..., hidden] spread by post, over the
        incoming streams (mixed by comb: outgoing k = sum_j comb[j, k] * incoming j)."""
        post, comb = weights
        residual = streams.float()
        if comb is not None:
            residual = torch.matmul(comb.transpose(-1, -2), residual)
        return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + residual).to(streams.dtype)


class HyperHead(ShardedModule):
    """The last streams collapsed to one hidden state: by the head's pre weights, or (no weights)
    their mean."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hyper_streams
        self.eps, self.norm_eps = float(cfg.raw["hyper_eps"]), cfg.norm_eps
        self.weighted = cfg.raw["hyper_head"] == "weighted"
        if self.weighted:
            self._param("fn", Shard((n, n * cfg.hidden_size)))
            self._param("base", Shard((n,)))
            self._param("scale", Shard((1,)))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        if not self.weighted:
            return streams.float().mean(dim=-2).to(streams.dtype)
        flat = streams.flatten(-2).float()
        mixes = F.linear(flat, self.fn.float()) * _inverse_rms(flat, self.norm_eps)
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return _collapse(streams, pre)


def spread(h: torch.Tensor, streams: int) -> torch.Tensor:
    """The embedding's output [..., hidden] as the first residual: every stream a copy."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], streams, h.shape[-1]).contiguous()


def hooked(streams: torch.Tensor, hook) -> torch.Tensor:
    """Run a residual hook on the streams' mean; what it changes in the mean (by returning a new
    tensor or in place, as the engine's per-row steering does) is added to every stream."""
    mean = streams.float().mean(dim=-2).to(streams.dtype)
    before = mean.clone()
    replaced = hook(mean)
    after = mean if replaced is None else replaced
    return streams + (after - before).unsqueeze(-2).to(streams.dtype)
