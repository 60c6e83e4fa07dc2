"""The state-space scan of Mamba-2 (SSD): per head a scalar decay and a state [head_dim, state_size]
updated by each token, read by chunks of tokens so a long prompt costs a few matrix products per
chunk rather than a step per token. Everything here is f32; the caller casts.

Per head h and token t, with dt the (already positive) time step and A_h < 0:
    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T        (S: [head_dim, state_size])
    y_t = S_t C_t + D_h x_t
A token with dt = 0 and x = 0 leaves the state as it was (left padding relies on it).
"""

from __future__ import annotations

import torch

CHUNK = 64  # tokens per chunk: the within-chunk products are [chunk, chunk] per head


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y [n, t, heads, head_dim] and the final state [n, heads, head_dim, state_size] for x [n, t,
    heads, head_dim], dt [n, t, heads], a [heads] (negative), b and c [n, t, heads, state_size]
    (already one per head), d [heads] and the state before the first token."""
    outs = []
    for start in range(0, x.shape[1], CHUNK):
        part = slice(start, start + CHUNK)
        y, state = _chunk(x[:, part], dt[:, part], a, b[:, part], c[:, part], state)
        outs.append(y)
    y = torch.cat(outs, dim=1) if outs else x.new_zeros(x.shape)
    return y + d[:, None] * x, state


def _chunk(x, dt, a, b, c, state):
    """One chunk of L tokens in closed form: cum[t] = sum_{s<=t} dt_s a is the log decay from the
    chunk's start to t, so token s reaches t (s <= t) scaled by exp(cum[t] - cum[s]) and the carried
    state by exp(cum[t])."""
    log_decay = dt * a  # [n, L, h]
    cum = torch.cumsum(log_decay, dim=1)
    length = x.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    # exp(cum[t] - cum[s]) below and on the diagonal, 0 above it (masked before exp: no overflow)
    gap = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(
        ~causal[None, :, :, None], float("-inf")
    )
    weights = torch.einsum("nthk,nshk->ntsh", c, b) * gap.exp()  # [n, t, s, h]
    xdt = x * dt.unsqueeze(-1)  # [n, L, h, p]
    within = torch.einsum("ntsh,nshp->nthp", weights, xdt)
    carried = torch.einsum("nthk,nhpk->nthp", c, state) * cum.exp().unsqueeze(-1)
    to_end = (cum[:, -1:] - cum).exp()  # [n, L, h]
    state = state * cum[:, -1].exp()[..., None, None] + torch.einsum(
        "nsh,nshp,nshk->nhpk", to_end, xdt, b
    )
    return within + carried, state
