"""Gated delta-rule linear attention (Qwen3-Next's linear_attn), a recurrent token mixer.

Per token: query, key and value pass a depthwise causal convolution and SiLU; query and key are
L2-normalised and the query scaled by one over the square root of its width. Each value head keeps a
[key width, value width] state that decays by exp(g), g = -exp(A_log) * softplus(a + dt_bias), and
is corrected toward the value with strength beta = sigmoid(b) (the delta rule); the query reads it
out. The read-out is RMS-normalised per head, scaled, gated by SiLU(z) and projected back.

Key heads group the value heads they serve (linear_num_value_heads / linear_num_key_heads each), and
tensor parallelism splits those groups as vLLM does: each rank holds whole key heads with their
value heads, so its projections are column shares, its convolution its own channels, its state its
own heads, and only the output projection reduces across ranks.

The scan runs in f32: token by token for short reads (decoding), in blocks of 64 tokens for longer
ones (each block's corrections one triangular solve, the state carried from block to block). Both
are the same sum in another order, and agree with Transformers' chunked and recurrent forms to
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.layers.activation import activation
from ster_dist.layers.causal_conv import causal_conv
from ster_dist.model.recurrent import RecurrentMixer
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.linear import ColumnLinear, FusedColumns, RowLinear, ShardedModule

SIZE_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def linear_sizes(raw: dict, path: str = "config.json") -> tuple[int, int, int, int, int]:
    """(key heads, value heads, key width, value width, convolution kernel), checked."""
    values = []
    for key in SIZE_KEYS:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise Refusal(
                f"invalid model config {path}: {key} is {value!r}; the gated delta-rule layers need it "
                "as a positive integer"
            )
        values.append(value)
    key_heads, value_heads = values[0], values[1]
    if value_heads % key_heads:
        raise Refusal(
            f"invalid model config {path}: linear_num_value_heads {value_heads} is not a multiple of "
            f"linear_num_key_heads {key_heads}; each key head serves a whole group of value heads"
        )
    return tuple(values)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # as FLA and Transformers compute it: x / sqrt(sum x^2 + eps)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


CHUNK = 64  # tokens per block of the chunked form
CHUNKED_FROM = 16  # shorter reads (decoding) run the plain recurrence


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [n, t, value heads, value width] and the new state [n, value heads, key width, value
    width] for queries and keys [n, t, key heads, key width] (already normalised and scaled), values
    [n, t, value heads, value width], log-decays g [n, t, value heads] (one per head, Qwen3-Next) or
    [n, t, value heads, key width] (one per key channel, Kimi's delta attention) and strengths beta
    [n, t, value heads], all f32. A token with g = 0 and beta = 0 leaves the state as it was."""
    groups = v.shape[2] // k.shape[2]
    if groups > 1:  # each key head serves its consecutive value heads
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    scan = delta_rule_chunked if v.shape[1] >= CHUNKED_FROM else delta_rule_recurrent
    return scan(q, k, v, g, beta, state)


def delta_rule_recurrent(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token, with as many key heads as value heads."""
    decay = g.exp()
    if decay.dim() == 3:  # one decay per head: the same for each of its key channels
        decay = decay.unsqueeze(-1)
    out = torch.empty_like(v)
    for i in range(v.shape[1]):
        k_i = k[:, i].unsqueeze(-1)  # [n, heads, key, 1]
        state = state * decay[:, i, :, :, None]
        # what the state predicts for this key
        remembered = (state * k_i).sum(-2)
        delta = (v[:, i] - remembered) * beta[:, i, :, None]
        state = state + k_i * delta.unsqueeze(-2)
        out[:, i] = (state * q[:, i].unsqueeze(-1)).sum(-2)
    return out, state


def delta_rule_chunked(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule a block of CHUNK tokens at a time. Within a block, with G_i the decay from the
    block's start to token i and S the state before it, each token's correction d_i = beta_i (v_i -
    G_i S^T k_i
    - sum_{j<i} G_i/G_j (k_i . k_j) d_j) is a unit lower-triangular system, solved for every block
      at once;
    only the step from block to block (through S) is sequential. A decay per key channel makes
    G_i/G_j a diagonal, inside the dot product (k_i . G_i/G_j k_j); its pairs are formed one block
    at a time, as a [CHUNK, CHUNK, key width] tensor of every block at once would be large. Trailing
    padding tokens (g = beta = 0) leave the state alone."""
    t = v.shape[1]
    pad = -t % CHUNK
    per_channel = g.dim() == 4
    q, k, v = (
        F.pad(x.transpose(1, 2), (0, 0, 0, pad)).unflatten(2, (-1, CHUNK)) for x in (q, k, v)
    )
    g = F.pad(g.transpose(1, 2), (0, 0, 0, pad) if per_channel else (0, pad)).unflatten(
        2, (-1, CHUNK)
    )
    beta = F.pad(beta.transpose(1, 2), (0, pad)).unflatten(2, (-1, CHUNK))
    log_decay = g.cumsum(3)  # [n, heads, blocks, CHUNK(, key)]
    # over key channels: the per-head decay broadcast, or each channel's own
    channel_decay = log_decay if per_channel else log_decay.unsqueeze(-1)
    q_from_start = q * channel_decay.exp()
    k_to_end = k * (channel_decay[..., -1:, :] - channel_decay).exp()
    k_from_start = k * (beta.unsqueeze(-1) * channel_decay.exp())
    block_decay = channel_decay[..., -1, :].exp()  # [n, heads, blocks, 1 or key]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=v.device).tril()
    if not per_channel:
        pairs = _block_pairs(q, k, v, beta, log_decay, k_from_start, causal, False)
    out = torch.empty_like(v)
    for c in range(v.shape[2]):
        if per_channel:
            written, from_state, reads = _block_pairs(
                q[:, :, c],
                k[:, :, c],
                v[:, :, c],
                beta[:, :, c],
                log_decay[:, :, c],
                k_from_start[:, :, c],
                causal,
                True,
            )
        else:
            written, from_state, reads = (x[:, :, c] for x in pairs)
        delta = written - from_state @ state
        out[:, :, c] = q_from_start[:, :, c] @ state + reads @ delta
        state = state * block_decay[:, :, c, :, None] + k_to_end[:, :, c].transpose(-1, -2) @ delta
    return out.flatten(2, 3)[:, :, :t].transpose(1, 2), state


def _block_pairs(q, k, v, beta, log_decay, k_from_start, causal, per_channel):
    """Within blocks: the corrections written from the values alone, what each correction takes from
    the state before the block (both through the triangular system), and each query's reads of the
    block's keys."""
    if per_channel:  # G_i/G_j per key channel, zero above the diagonal: [..., CHUNK, CHUNK, key]
        between = (
            (log_decay.unsqueeze(-2) - log_decay.unsqueeze(-3))
            .masked_fill(~causal[..., None], float("-inf"))
            .exp()
        )
        keys = (k.unsqueeze(-2) * k.unsqueeze(-3) * between).sum(-1)
        reads = (q.unsqueeze(-2) * k.unsqueeze(-3) * between).sum(-1)
        system = beta.unsqueeze(-1) * keys
    else:  # G_i / G_j for j <= i (zero above the diagonal)
        between = (
            (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2))
            .masked_fill(~causal, float("-inf"))
            .exp()
        )
        system = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * between
        reads = (q @ k.transpose(-1, -2)) * between
    # the system's diagonal is taken as one
    written = torch.linalg.solve_triangular(
        system, v * beta.unsqueeze(-1), upper=False, unitriangular=True
    )
    from_state = torch.linalg.solve_triangular(
        system, k_from_start, upper=False, unitriangular=True
    )
    return written, from_state, reads


class GatedDeltaNet(RecurrentMixer, ShardedModule):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelCtx):
        super().__init__()
        key_heads, value_heads, dk, dv, kernel = linear_sizes(cfg.raw)
        if key_heads < ctx.tp_size:
            raise Refusal(
                f"the gated delta-rule layers have {key_heads} key heads, fewer than the {ctx.tp_size} "
                "tensor-parallel ranks; each rank needs a whole key head: lower --tp"
            )
        hidden, per_key = cfg.hidden_size, value_heads // key_heads
        g0, g1 = ctx.split(key_heads)
        v0, v1 = g0 * per_key, g1 * per_key
        self.layer = layer
        self.key_width, self.value_width, self.kernel = dk, dv, kernel
        self.local_key_heads, self.local_value_heads = g1 - g0, v1 - v0
        key_rows, value_rows = ((g0 * dk, g1 * dk),), ((v0 * dv, v1 * dv),)
        self.q = ColumnLinear(hidden, key_heads * dk, key_rows, False)
        self.k = ColumnLinear(hidden, key_heads * dk, key_rows, False)
        self.v = ColumnLinear(hidden, value_heads * dv, value_rows, False)
        self.qkv = FusedColumns(self.q, self.k, self.v)  # one product once loaded
        self.z = ColumnLinear(hidden, value_heads * dv, value_rows, False)  # the output gate
        self.b = ColumnLinear(hidden, value_heads, ((v0, v1),), False)  # write strength
        self.a = ColumnLinear(hidden, value_heads, ((v0, v1),), False)  # decay input
        # one convolution over every query, then key, then value channel: this rank's channels of
        # each
        key_dim = key_heads * dk
        self.channels = (
            key_rows[0],
            (key_dim + g0 * dk, key_dim + g1 * dk),
            (2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv),
        )
        # OLMo Hybrid stores each of the three convolutions apart (q_conv1d, k_conv1d, v_conv1d)
        self.separate_convs = bool(cfg.raw.get("linear_separate_convs"))
        if self.separate_convs:
            for name, total, rows in (
                ("q_conv", key_dim, key_rows[0]),
                ("k_conv", key_dim, key_rows[0]),
                ("v_conv", value_heads * dv, value_rows[0]),
            ):
                self._param(name, Shard((total, 1, kernel), 0, (rows,)))
        else:
            self._param(
                "conv_weight", Shard((2 * key_dim + value_heads * dv, 1, kernel), 0, self.channels)
            )
        self._param("A_log", Shard((value_heads,), 0, ((v0, v1),)))
        self._param("dt_bias", Shard((value_heads,), 0, ((v0, v1),)))
        self._param("norm_weight", Shard((dv,)))  # one scale for every head's read-out
        self.out = RowLinear(value_heads * dv, hidden, ctx, False, cols=(v0 * dv, v1 * dv))
        # OLMo Hybrid: the read-out norm's own epsilon, and write strengths up to two (negative
        # eigenvalues)
        self.eps = float(cfg.raw.get("linear_norm_eps") or cfg.norm_eps)
        self.beta_scale = 2.0 if cfg.raw.get("linear_allow_neg_eigval") else 1.0
        self.act = activation(cfg.hidden_act)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        conv_channels = sum(b - a for a, b in self.channels)
        return (
            (conv_channels, self.kernel - 1),
            (self.local_value_heads, self.key_width, self.value_width),
        )

    def _scan(self, x: torch.Tensor, valid: torch.Tensor | None, state: tuple[torch.Tensor, ...]):
        conv_state, recurrent = state
        n, t, _ = x.shape
        if valid is not None:  # left padding reads as nothing, as Transformers masks it
            x = x * valid.unsqueeze(-1).to(x.dtype)
        mixed = torch.cat(self.qkv(x), dim=-1)
        weight = (
            torch.cat([self.q_conv, self.k_conv, self.v_conv])
            if self.separate_convs
            else self.conv_weight
        )
        mixed, conv_state = causal_conv(mixed, weight[:, 0], None, conv_state, valid)
        mixed = self.act(mixed)
        local_k = self.local_key_heads * self.key_width
        q, k, v = mixed.split([local_k, local_k, mixed.shape[-1] - 2 * local_k], dim=-1)
        q = l2norm(q.view(n, t, -1, self.key_width).float()) * self.key_width**-0.5
        k = l2norm(k.view(n, t, -1, self.key_width).float())
        v = v.view(n, t, -1, self.value_width).float()
        beta = self.b(x).float().sigmoid()
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(self.a(x).float() + self.dt_bias.float())
        if valid is not None:  # padding leaves the state as it was: no decay, no write
            keep = valid.unsqueeze(-1)
            beta, g = beta * keep, g * keep
        y, recurrent = gated_delta_rule(q, k, v, g, beta, recurrent.float())
        y = self._gated_norm(y.to(x.dtype), self.z(x).view(n, t, -1, self.value_width))
        return self.out(y.reshape(n, t, -1)), (conv_state, recurrent.to(state[1].dtype))

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # Transformers' RMSNormGated: normalise in f32, scale in the input dtype, gate by SiLU(z) in
        # f32
        dtype = y.dtype
        h = y.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm_weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)
