"""The shard plan and streaming loader: name-map errors name the tensor, fused layouts
split as the families store them, and a rank's plan reads only its rows."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.families.layouts import fused_qkv
from ster_dist.load import load_decoder
from ster_dist.model.decoder import Decoder
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.shard.plan import build_plan, fused_source_rows
from ster_dist.shard.source import SafetensorsSource
from tests.tiny_models import make_tiny, read_config


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny("llama", directory)
    return directory


def _rewrite(directory, tmp_path, edit):
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_unmapped_checkpoint_tensor_is_named(llama_dir, tmp_path):
    path = _rewrite(
        llama_dir,
        tmp_path,
        lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)),
    )
    cfg = from_hf(read_config(llama_dir))
    with pytest.raises(
        Refusal, match=r"checkpoint tensor model\.layers\.0\.mystery\.weight is not mapped"
    ):
        load_decoder(cfg, SafetensorsSource([path]))


def test_missing_parameter_is_named(llama_dir, tmp_path):
    path = _rewrite(llama_dir, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    cfg = from_hf(read_config(llama_dir))
    with pytest.raises(
        Refusal, match=r"parameter layers\.1\.mlp\.up\.weight is filled by no checkpoint tensor"
    ):
        load_decoder(cfg, SafetensorsSource([path]))


def test_bias_the_config_turns_off_is_refused(llama_dir, tmp_path):
    path = _rewrite(
        llama_dir,
        tmp_path,
        lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(64)),
    )
    cfg = from_hf(read_config(llama_dir))
    with pytest.raises(Refusal, match=r"q_proj\.bias .* has no parameter"):
        load_decoder(cfg, SafetensorsSource([path]))


def test_shape_unlike_the_config_is_refused_with_both_shapes(llama_dir, tmp_path):
    path = _rewrite(
        llama_dir,
        tmp_path,
        lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(48, 60)),
    )
    cfg = from_hf(read_config(llama_dir))
    with pytest.raises(Refusal, match=r"shape \[48, 60\] but the config implies \[48, 64\]"):
        load_decoder(cfg, SafetensorsSource([path]))


def test_head_by_head_rows_gather_each_heads_part():
    # GPT-NeoX: rows go [q0 k0 v0 | q1 k1 v1 | ...], head_dim 2, 3 heads
    cfg = from_hf(
        {
            "model_type": "gpt_neox",
            "hidden_size": 6,
            "num_attention_heads": 3,
            "num_hidden_layers": 1,
            "vocab_size": 10,
            "intermediate_size": 8,
        }
    )
    layout = fused_qkv("x", groups="heads", q_count="one", kv_count="one")[0].target
    assert fused_source_rows(layout, 0, (0, 6), cfg) == [(0, 2, 0), (6, 8, 2), (12, 14, 4)]
    assert fused_source_rows(layout, 2, (2, 4), cfg) == [(10, 12, 0)]


def test_tensor_parallel_plan_reads_only_this_ranks_rows(tmp_path):
    directory = tmp_path / "phi3"
    make_tiny("phi3", directory)
    cfg = from_hf(read_config(directory))
    source = SafetensorsSource(sorted(directory.glob("*.safetensors")))
    shapes = {n: source.shape(n) for n in source.names()}
    d, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    for rank in range(2):
        with torch.device("meta"):
            shards = Decoder(cfg, ParallelCtx(rank, 2)).shards()
        plan = build_plan(cfg.spec, cfg, shards, shapes)
        by_param = {(r.source, r.param): r for r in plan.reads}
        q = by_param[("model.layers.0.self_attn.qkv_proj.weight", "layers.0.attn.q.weight")]
        k = by_param[("model.layers.0.self_attn.qkv_proj.weight", "layers.0.attn.k.weight")]
        half = heads // 2 * d
        assert [(p.rows.start, p.rows.stop) for p in q.pieces] == [(rank * half, (rank + 1) * half)]
        kv_rows = kv // 2 * d
        assert [(p.rows.start, p.rows.stop) for p in k.pieces] == [
            (heads * d + rank * kv_rows, heads * d + (rank + 1) * kv_rows)
        ]
        gate = by_param[("model.layers.0.mlp.gate_up_proj.weight", "layers.0.mlp.gate.weight")]
        inner = cfg.intermediate_size // 2
        assert [(p.rows.start, p.rows.stop) for p in gate.pieces] == [
            (rank * inner, (rank + 1) * inner)
        ]
        down = by_param[("model.layers.0.mlp.down_proj.weight", "layers.0.mlp.down.weight")]
        assert [(p.cols.start, p.cols.stop) for p in down.pieces] == [
            (rank * inner, (rank + 1) * inner)
        ]


def test_loader_copies_exactly_the_checkpoint_bytes(llama_dir):
    cfg = from_hf(read_config(llama_dir))
    source = SafetensorsSource(sorted(llama_dir.glob("*.safetensors")))
    model = load_decoder(cfg, source)
    total = sum(
        t.numel() * t.element_size()
        for t in load_file(str(llama_dir / "model.safetensors")).values()
    )
    assert source.bytes_read == total
    reference = load_file(str(llama_dir / "model.safetensors"))
    assert torch.equal(
        model.layers[1].attn.k.weight, reference["model.layers.1.self_attn.k_proj.weight"]
    )
