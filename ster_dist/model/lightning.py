"""Lightning attention (MiniMax-Text-01's linear-attention layers), a recurrent token mixer.

Per token: one projection (qkv_proj) through the activation gives each head its query, key and
value, stored head by head (a head's query, key, value rows in turn). Each head keeps a [head_dim,
head_dim] state S that decays by exp(-slope) per position and gains k^T v; the query reads it, o = q
S. The slope of head h (from one) is 2^(-8 / heads)^h, scaled by 1 - layer / (layers - 1) + 1e-5 as
Transformers computes it. The read-out of every head is RMS-normalised together (one norm over the
whole width, epsilon 1e-6), multiplied by the sigmoid of output_gate(x) and projected back by
out_proj.

Tensor parallelism splits the heads as vLLM does: qkv_proj and output_gate are column shares by head
(a head's rows are contiguous), the norm's scale its heads' entries, out_proj its columns (the one
reduction of the output); the norm's statistic is a sum of squares over every head, so its local
sums are all-reduced first.

The scan runs in f32 in blocks of block_size tokens (Transformers' intra- and inter-block form:
within a block the decayed products q k^T, across blocks the state), a decode step being a block of
one. Left padding reads as zeros and decays nothing, so a fresh row's state stays zero through it.
"""

from __future__ import annotations

import torch

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.layers.activation import activation
from ster_dist.model.recurrent import RecurrentMixer
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ColumnLinear, RowLinear, ShardedModule

# Transformers' and MiniMax's own read-out norm keeps its class default, whatever rms_norm_eps says
NORM_EPS = 1e-6


def slopes(heads: int, layer: int, layers: int) -> torch.Tensor:
    """Each head's decay rate per position in this layer [heads], as Transformers' get_slope_rate
    computes it."""
    base = 1 / (2 ** (8 / heads))
    factor = 1 - layer / (layers - 1 + 1e-5) + 1e-5
    # on the host even while shapes are built
    return base ** (torch.arange(heads, device="cpu") + 1) * factor


def lightning_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    state: torch.Tensor,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [n, heads, t, d] and the new state [n, heads, d, d] for queries, keys and values [n,
    heads, t, d], log-decays [n, heads, t] (-slope, zero where a token leaves the state alone) and
    the state before them, all f32. Within a block of L tokens, with G_i the summed log-decay from
    its start through token i and S the state before it: o_i = exp(G_i) q_i S + sum_{j<=i} exp(G_i -
    G_j) (q_i . k_j) v_j, and the state after it exp(G_L) S + sum_j exp(G_L - G_j) k_j^T v_j."""
    t = v.shape[2]
    out = torch.empty_like(v)
    causal = torch.ones(min(block, t), min(block, t), dtype=torch.bool, device=v.device).tril()
    for start in range(0, t, block):
        rows = slice(start, start + block)
        qb, kb, vb = q[:, :, rows], k[:, :, rows], v[:, :, rows]
        g = log_decay[:, :, rows].cumsum(-1)
        size = g.shape[-1]
        between = (
            (g.unsqueeze(-1) - g.unsqueeze(-2))
            .masked_fill(~causal[:size, :size], float("-inf"))
            .exp()
        )
        out[:, :, rows] = (qb * g.exp().unsqueeze(-1)) @ state + (
            (qb @ kb.transpose(-1, -2)) * between
        ) @ vb
        to_end = (g[..., -1:] - g).exp().unsqueeze(-1)
        state = state * g[..., -1:].exp().unsqueeze(-1) + (kb * to_end).transpose(-1, -2) @ vb
    return out, state


def lightning_sizes(cfg: ModelConfig, path: str = "config.json") -> tuple[int, int, int]:
    """(heads, head width, block size), checked: lightning heads are the attention heads' count and
    width."""
    block = cfg.raw.get("block_size", 256)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise Refusal(
            f"invalid model config {path}: block_size is {block!r}; lightning attention needs it as a "
            "positive integer (MiniMax's default is 256)"
        )
    if cfg.num_heads < 1 or cfg.head_dim < 1:
        raise Refusal(
            f"invalid model config {path}: lightning attention needs num_attention_heads and head_dim "
            "as positive integers"
        )
    return cfg.num_heads, cfg.head_dim, block


class LightningAttention(RecurrentMixer, ShardedModule):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        heads, d, block = lightning_sizes(cfg)
        if heads < ctx.tp_size:
            raise Refusal(
                f"the lightning attention layers have {heads} heads, fewer than the {ctx.tp_size} "
                "tensor-parallel ranks; each rank needs a whole head: lower --tp"
            )
        h0, h1 = ctx.split(heads)
        hidden, width = cfg.hidden_size, heads * d
        self.layer, self.head_dim, self.block, self.local_heads, self.width = (
            layer,
            d,
            block,
            h1 - h0,
            width,
        )
        self.ctx = ctx
        self.qkv = ColumnLinear(hidden, 3 * width, ((3 * h0 * d, 3 * h1 * d),), False)
        self.gate = ColumnLinear(hidden, width, ((h0 * d, h1 * d),), False)
        self._param("norm_weight", Shard((width,), 0, ((h0 * d, h1 * d),)))
        self.out = RowLinear(width, hidden, ctx, False, cols=(h0 * d, h1 * d))
        # numbers, not a buffer: the decoder is built on the meta device and only parameters are
        # filled
        self.slope = slopes(heads, layer, cfg.num_layers)[h0:h1].tolist()
        self.act = activation(cfg.hidden_act)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.local_heads, self.head_dim, self.head_dim),)

    def _scan(self, x: torch.Tensor, valid: torch.Tensor | None, state: tuple[torch.Tensor, ...]):
        n, t, _ = x.shape
        qkv = self.act(self.qkv(x))
        slope = torch.tensor(self.slope, dtype=torch.float32, device=x.device)
        log_decay = (-slope).view(1, -1, 1).expand(n, -1, t)
        if valid is not None:  # left padding: no input, no decay (Transformers zeroes its qkv)
            qkv = qkv * valid.unsqueeze(-1).to(qkv.dtype)
            log_decay = log_decay * valid.unsqueeze(1)
        q, k, v = (
            qkv.view(n, t, self.local_heads, 3 * self.head_dim)
            .float()
            .transpose(1, 2)
            .split(self.head_dim, -1)
        )
        y, recurrent = lightning_scan(q, k, v, log_decay, state[0].float(), self.block)
        y = self._norm(y.to(x.dtype).transpose(1, 2).reshape(n, t, -1))
        y = torch.sigmoid(self.gate(x)) * y
        return self.out(y), (recurrent.to(state[0].dtype),)

    def _norm(self, y: torch.Tensor) -> torch.Tensor:
        # Transformers' RMSNorm over every head's read-out: this rank's sum of squares, summed over
        # the ranks
        dtype = y.dtype
        h = y.float()
        squares = self.ctx.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(squares / self.width + NORM_EPS)
        return self.norm_weight * h.to(dtype)
