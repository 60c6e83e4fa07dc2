"""Rotary position embeddings: inverse frequencies for every scaling seeds/000 names,
cos/sin tables, and rotation by halves or by interleaved pairs over a head's rotated share.
"""

from __future__ import annotations

import math

import torch

from ster_dist.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2], attention factor that scales cos and sin)."""
    dim, base = rope.rotary_dim, rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (base**exponents)
    kind = rope.rope_type
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / rope.factor, 1.0
    # only the first pairs turn; the others, at frequency zero, pass through
    if kind == "proportional":
        turned = int(rope.proportion * dim // 2)
        return torch.cat((inv[:turned], torch.zeros(dim // 2 - turned))) / rope.factor, 1.0
    if kind == "llama3":
        old = rope.original_max_position
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "longrope":
        factor = rope.factor
        attn = rope.attention_factor
        if attn is None:
            attn = (
                1.0
                if factor <= 1.0
                else math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position))
            )
        # PhiMoE: each table has its own scale, in place of the factor's
        if rope.short_mscale is not None:
            attn = rope.long_mscale if long else rope.short_mscale
        ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (ext * base**exponents), attn
    if kind == "yarn":
        return _yarn(rope, exponents)
    raise ValueError(kind)


def _yarn(rope: RopeConfig, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.rotary_dim, rope.theta, rope.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.attention_factor
    if attn is None:
        attn = (
            mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
            if rope.mscale and rope.mscale_all_dim
            else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos = base**exponents
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, attn


class RotaryTables:
    """cos/sin tables per RopeConfig, built once per model and looked up by position."""

    def __init__(self, max_position: int):
        self.max_position = max_position
        self._tables: dict[tuple[RopeConfig, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    def lookup(self, rope: RopeConfig, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin of shape [batch, seq, rotary_dim/2] for these positions."""
        long = (
            rope.rope_type == "longrope" and int(positions.max()) + 1 > rope.original_max_position
        )
        key = (rope, long)
        if key not in self._tables:
            inv, attn = inverse_frequencies(rope, long)
            length = max(self.max_position, int(positions.max()) + 1)
            angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)
            self._tables[key] = (angles.cos() * attn, angles.sin() * attn)
        cos, sin = self._tables[key]
        if int(positions.max()) >= cos.shape[0]:
            del self._tables[key]
            return self.lookup(rope, positions, dtype)
        return cos[positions].to(dtype), sin[positions].to(dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate the first 2*cos.shape[-1] channels of x [batch, heads, seq, head_dim]; pass the
    rest."""
    rot = cos.shape[-1] * 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
