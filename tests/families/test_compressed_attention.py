"""DeepSeek-V4's attention layer kinds (model/compressed_attention.py, window_compressor.py,
compressed_indexer.py) against Transformers' own DeepseekV4Attention on the same weights: the
sliding, heavily compressed and compressed sparse layers, read whole, and read through the static
cache as a prompt then one token at a time across window closings (Transformers' own cache carrying
its compressor state alongside)."""

from __future__ import annotations

import pytest
import torch

from ster_dist.config import RopeConfig
from ster_dist.model.cache import KVCache
from ster_dist.model.compressed_attention import (
    HEAVY,
    SLIDING,
    SPARSE,
    CompressedAttention,
    V4Layer,
)
from ster_dist.model.rope import RotaryTables
from ster_dist.model.step import StepState
from ster_dist.parallel.ctx import SINGLE

transformers_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

KINDS = [SLIDING, SPARSE, HEAVY]
RATES = {SPARSE: 2, HEAVY: 4}


def _config(yarn: bool):
    from transformers import DeepseekV4Config

    rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8) if yarn else None
    cfg = DeepseekV4Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=24,
        partial_rotary_factor=0.5,
        o_groups=2,
        o_lora_rank=12,
        sliding_window=6,
        layer_types=KINDS,
        compress_rates={SPARSE: 2, HEAVY: 4},
        index_n_heads=4,
        index_head_dim=8,
        index_topk=3,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters=rope,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
    )
    cfg._attn_implementation = "eager"
    return cfg


def _rope(cfg, kind: str) -> RopeConfig:
    rd = cfg.qk_rope_head_dim
    if kind == SLIDING:
        return RopeConfig(theta=cfg.rope_theta, rotary_dim=rd, interleaved=True)
    p = cfg.rope_parameters["compress"]
    if p["rope_type"] == "yarn":
        return RopeConfig(
            theta=cfg.compress_rope_theta,
            rotary_dim=rd,
            interleaved=True,
            rope_type="yarn",
            factor=p["factor"],
            original_max_position=p["original_max_position_embeddings"],
            attention_factor=1.0,
        )
    return RopeConfig(theta=cfg.compress_rope_theta, rotary_dim=rd, interleaved=True)


def _ours(cfg, layer: int) -> V4Layer:
    kind = cfg.layer_types[layer]
    return V4Layer(
        kind=kind,
        hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        rope_dim=cfg.qk_rope_head_dim,
        q_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups,
        o_rank=cfg.o_lora_rank,
        window=cfg.sliding_window,
        rope=_rope(cfg, kind),
        eps=cfg.rms_norm_eps,
        rate=RATES.get(kind, 0),
        index_heads=cfg.index_n_heads,
        index_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
    )


_NAMES = {
    "q_a_proj.weight": "q_a.weight",
    "q_b_proj.weight": "q_b.weight",
    "kv_proj.weight": "kv.weight",
    "o_a_proj.weight": "o_a.weight",
    "o_b_proj.weight": "o_b.weight",
    "sinks": "sinks.weight",
    "compressor.kv_proj.weight": "compressor.kv.weight",
    "compressor.gate_proj.weight": "compressor.gate.weight",
    "compressor.position_bias": "compressor.position_bias.weight",
    "compressor.indexer.kv_proj.weight": "indexer.compressor.kv.weight",
    "compressor.indexer.gate_proj.weight": "indexer.compressor.gate.weight",
    "compressor.indexer.position_bias": "indexer.compressor.position_bias.weight",
    "compressor.indexer.kv_norm.weight": "indexer.compressor.kv_norm.weight",
    "compressor.indexer.q_b_proj.weight": "indexer.q_b.weight",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj.weight",
}


def _pair(cfg, layer: int, seed: int):
    theirs = transformers_v4.DeepseekV4Attention(cfg, layer).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() > 1 else 1.0))
    ours = CompressedAttention(_ours(cfg, layer), layer, SINGLE)
    state = {
        _NAMES.get(k, k): v.clone() for k, v in theirs.state_dict().items() if "rotary" not in k
    }
    ours.load_state_dict(state)
    return theirs, ours


def _theirs_forward(theirs, cfg, rotary, x, start: int, cache):
    """Transformers' layer as its model calls it, the additive sliding-window mask over the keys its
    cache keeps (the last sliding_window - 1 positions before this call's)."""
    t, window = x.shape[1], cfg.sliding_window
    kept = min(start, window - 1) if cache is not None else 0
    positions = torch.arange(start, start + t).unsqueeze(0).expand(x.shape[0], -1)
    key_pos = torch.arange(start - kept, start + t)
    distance = positions[0].unsqueeze(1) - key_pos.unsqueeze(0)
    allowed = (distance >= 0) & (distance < window)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask = mask.view(1, 1, t, -1).expand(x.shape[0], -1, -1, -1)
    tables = {
        kind: rotary(x, position_ids=positions, layer_type=kind) for kind in ("main", "compress")
    }
    out, _ = theirs(
        x, position_embeddings=tables, position_ids=positions, attention_mask=mask, cache=cache
    )
    return out


def _cache(cfg):
    from transformers import DynamicCache

    return DynamicCache(config=cfg)


@pytest.mark.parametrize("yarn", [False, True])
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_layer_equals_transformers_whole_and_cached(layer, yarn):
    cfg = _config(yarn)
    theirs, ours = _pair(cfg, layer, seed=layer + 10)
    rotary = transformers_v4.DeepseekV4RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, cfg.hidden_size, generator=gen)
    tables = RotaryTables(64)
    with torch.no_grad():
        whole = _theirs_forward(theirs, cfg, rotary, x, 0, None)
        positions = torch.arange(16).expand(2, -1)
        got = ours(x, StepState(positions, torch.ones(2, 16, dtype=torch.bool), tables, None))
        assert (got - whole).abs().max() < 1e-4 * whole.abs().max()

        # a prompt of 7 (no window closed at the heavy rate), then single tokens across closings:
        # ours through the
        # static cache, theirs through its own
        cache = KVCache(
            [ours.kv_shape if i == layer else None for i in range(3)], 2, 16, torch.float32
        )
        hf_cache = _cache(cfg)
        steps = [(0, 7)] + [(p, p + 1) for p in range(7, 16)]
        for a, b in steps:
            part = x[:, a:b]
            theirs_part = _theirs_forward(theirs, cfg, rotary, part, a, hf_cache)
            step = StepState(
                torch.arange(a, b).expand(2, -1),
                torch.ones(2, b - a, dtype=torch.bool),
                tables,
                cache,
            )
            ours_part = ours(part, step)
            scale = whole[:, a:b].abs().max()
            assert (ours_part - whole[:, a:b]).abs().max() < 1e-4 * scale, (a, b)
            assert (theirs_part - whole[:, a:b]).abs().max() < 1e-4 * scale, (a, b)


def test_left_padding_keeps_windows_by_position():
    """A row left-padded in a batch: its windows follow its own positions, so it reads as it does
    alone."""
    cfg = _config(False)
    _, ours = _pair(cfg, 1, seed=5)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 9, cfg.hidden_size, generator=gen)
    tables = RotaryTables(64)
    with torch.no_grad():
        alone = ours(
            x,
            StepState(
                torch.arange(9).unsqueeze(0), torch.ones(1, 9, dtype=torch.bool), tables, None
            ),
        )
        padded = torch.cat((torch.zeros(1, 3, cfg.hidden_size), x), dim=1)
        positions = torch.cat((torch.zeros(3, dtype=torch.long), torch.arange(9))).unsqueeze(0)
        valid = positions.new_ones(1, 12, dtype=torch.bool)
        valid[:, :3] = False
        cache = KVCache([None, ours.kv_shape, None], 1, 14, torch.float32)
        got = ours(padded, StepState(positions, valid, tables, cache))
        assert (got[:, 3:] - alone).abs().max() < 1e-4 * alone.abs().max()
