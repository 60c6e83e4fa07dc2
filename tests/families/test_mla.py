"""Multi-head latent attention: its variants against Transformers (query bottleneck or not,
adjacent-pair or halves rotation, biased projections, YaRN's score temperature), the compressed
cache, and how its heads split under tensor parallelism."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.load import load_model
from ster_dist.model.decoder import Decoder
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.tiny_models import TINY, make_tiny


def _build(monkeypatch, tmp_path, variant: str, **overrides):
    config_cls, model_cls, kwargs = TINY[variant]
    monkeypatch.setitem(TINY, variant, (config_cls, model_cls, {**kwargs, **overrides}))
    reference = make_tiny(variant, tmp_path)
    return reference, load_model(resolve(str(tmp_path)), "f32")


def _ids(seed=0):
    return torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "variant, overrides",
    [
        ("deepseek_v3", dict(rope_interleave=False)),  # halves, like MiniCPM3
        # biased latent projections, one q_proj
        ("deepseek_v3", dict(attention_bias=True, q_lora_rank=None)),
        (
            "deepseek_v2",
            dict(q_lora_rank=20, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
        ),
        ("minicpm3", dict(q_lora_rank=None)),
    ],
)
def test_latent_attention_variants_match_transformers(monkeypatch, tmp_path, variant, overrides):
    reference, loaded = _build(monkeypatch, tmp_path, variant, **overrides)
    ids = _ids()
    with torch.no_grad():
        result = compare(loaded.model(ids), reference(ids).logits)
    assert result["max_relative_error"] < 1e-4, result


def test_the_rotation_layout_is_live(monkeypatch, tmp_path):
    """Reading DeepSeek's adjacent pairs as halves must break parity, or the switch is not wired."""
    reference, _ = _build(monkeypatch, tmp_path, "deepseek_v3")
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "rope_interleave": False}))
    wrong = load_model(resolve(str(tmp_path)), "f32")
    ids = _ids(1)
    with torch.no_grad():
        assert compare(wrong.model(ids), reference(ids).logits)["max_relative_error"] > 1e-3


def _v3(**keys) -> dict:
    return {
        "model_type": "deepseek_v3",
        "vocab_size": 100,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 128,
        "head_dim": 16,
        "intermediate_size": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_group": 2,
        "topk_group": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 24,
        "max_position_embeddings": 4096,
        **keys,
    }


def test_latent_sizes_and_the_yarn_score_temperature():
    plain = from_hf(_v3())
    # every head has its own key: the config's num_key_value_heads and head_dim do not apply
    assert (plain.num_kv_heads, plain.head_dim, plain.layer_rope[0].rotary_dim) == (4, 24, 8)
    assert plain.attn_scale == pytest.approx(24**-0.5) and plain.layer_rope[0].interleaved
    yarn = {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    }
    cfg = from_hf(_v3(rope_scaling=yarn))
    m = 0.1 * 0.707 * math.log(40) + 1
    assert cfg.attn_scale == pytest.approx(24**-0.5 * m * m)
    assert from_hf(_v3(rope_scaling={**yarn, "mscale_all_dim": 0})).attn_scale == pytest.approx(
        24**-0.5
    )


def test_the_cache_holds_the_latent_not_per_head_keys(monkeypatch, tmp_path):
    _, loaded = _build(monkeypatch, tmp_path, "deepseek_v3")
    cfg = loaded.cfg
    cache = loaded.model.new_cache(2, 30)
    assert cache.keys[0].shape == (2, 1, 30, cfg.mla.kv_lora_rank)
    assert cache.values[0].shape == (2, 1, 30, cfg.mla.qk_rope_head_dim)
    ids = _ids(2)[:, :30]
    with torch.no_grad():
        whole = loaded.model(ids)
        parts = [loaded.model(ids[:, :17], cache=cache)] + [
            loaded.model(ids[:, t : t + 1], cache=cache) for t in range(17, 30)
        ]
    assert compare(torch.cat(parts, 1), whole)["max_relative_error"] < 1e-5


def test_heads_split_under_tensor_parallelism_and_the_latent_stays_whole():
    cfg = from_hf(_v3())
    qk, per_head = 24, 16 + 24
    for rank in range(2):
        shards = _shards(cfg, rank)
        assert shards["layers.0.attn.q_a.weight"].ranges == ((0, 48),)
        assert shards["layers.0.attn.kv_a.weight"].ranges == ((0, 32 + 8),)
        assert shards["layers.0.attn.q_b.weight"].ranges == ((rank * 2 * qk, (rank + 1) * 2 * qk),)
        assert shards["layers.0.attn.kv_b.weight"].ranges == (
            (rank * 2 * per_head, (rank + 1) * 2 * per_head),
        )
        assert shards["layers.0.attn.o.weight"].ranges == ((rank * 2 * 24, (rank + 1) * 2 * 24),)


def _shards(cfg, rank):
    with torch.device("meta"):
        return Decoder(cfg, ParallelCtx(rank, 2)).shards()
