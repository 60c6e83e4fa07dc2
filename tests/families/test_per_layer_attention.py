"""Attention that differs from layer to layer (llama4_text, mimo_v2_flash, laguna) beyond the shared
parity, TP, EP and paged checks their tiny checkpoints join: a chunked prefill across Llama 4's
attention chunks, Xiaomi's own MiMo-V2-Flash config and tensor names read as Transformers' are,
Laguna's sliding-layer sinks, and the refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.shard.writer import placements
from tests.tiny_models import make_tiny, read_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    built: dict = {}

    def get(variant):
        if variant not in built:
            directory = tmp_path_factory.mktemp(variant)
            built[variant] = (directory, make_tiny(variant, directory))
        return built[variant]

    return get


def _ids(length: int = 30, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (2, length), generator=torch.Generator().manual_seed(seed))


def _copy(source, directory, config: dict, rename=lambda name: name, extra: dict | None = None):
    """The checkpoint at source with its config replaced and its tensors renamed (and `extra`
    added)."""
    directory.mkdir()
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, directory / path.name)
    tensors = {rename(name): t for name, t in load_file(str(source / "model.safetensors")).items()}
    save_file({**tensors, **(extra or {})}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return resolve(str(directory))


def test_a_prefill_in_pieces_across_chunk_boundaries_equals_one_pass(tiny):
    """Llama 4's chunks of five positions: pieces that start and end inside chunks, then single
    steps."""
    directory, _ = tiny("llama4_text")
    model = load_model(resolve(str(directory)), "f32").model
    assert any(model.cfg.layer_chunk) and any(model.cfg.layer_query_temperature)
    ids = _ids()
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache(2, ids.shape[1])
        parts, start = [], 0
        for size in (3, 9, 1, 6, 1, 1, 7, 2):
            parts.append(model(ids[:, start : start + size], cache=cache))
            start += size
    assert start == ids.shape[1]
    assert compare(torch.cat(parts, dim=1), whole)["max_relative_error"] < 1e-5


def test_xiaomi_config_and_names_read_as_transformers(tiny, tmp_path):
    """MiMo-V2-Flash as Xiaomi publishes it: hybrid_layer_pattern, swa_num_key_value_heads,
    sliding_window_size, the sink switches, rope_theta / swa_rope_theta, moe_layer_freq,
    attention_sink_bias and an MTP layer."""
    directory, reference = tiny("mimo_v2_flash")
    config = read_config(directory)
    kinds = config.pop("layer_types")
    rotations = config.pop("rope_parameters")
    config.pop("mlp_layer_types")
    config.update(
        hybrid_layer_pattern=[int(kind == "sliding_attention") for kind in kinds],
        swa_num_key_value_heads=2 * config["num_key_value_heads"],
        sliding_window_size=config.pop("sliding_window") - 1,
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
        rope_theta=rotations["full_attention"]["rope_theta"],
        swa_rope_theta=rotations["sliding_attention"]["rope_theta"],
        partial_rotary_factor=rotations["full_attention"]["partial_rotary_factor"],
        moe_layer_freq=[0] + [1] * (config["num_hidden_layers"] - 1),
        num_nextn_predict_layers=1,
    )
    checkpoint = _copy(
        directory,
        tmp_path / "xiaomi",
        config,
        lambda name: name.replace("self_attn.sinks", "self_attn.attention_sink_bias"),
        {"model.mtp.layers.0.input_layernorm.weight": torch.ones(config["hidden_size"])},
    )
    loaded = load_model(checkpoint, "f32")
    ids = _ids()
    with torch.no_grad():
        result = compare(loaded.model(ids), reference(ids).logits)
    assert result["max_relative_error"] < 1e-4, result


def test_laguna_sinks_sit_on_the_sliding_layers_and_take_their_share(tiny, tmp_path):
    """Transformers' Laguna has no sinks: with sinks far below every score the model is
    Transformers', and with sinks at zero the sliding layers' attention gives them a share."""
    directory, reference = tiny("laguna")
    config = {**read_config(directory), "swa_attention_sink_enabled": True}
    sliding = [i for i, kind in enumerate(config["layer_types"]) if kind == "sliding_attention"]
    ids = _ids()
    with torch.no_grad():
        theirs = reference(ids).logits
    for value, matches in ((-1e4, True), (0.0, False)):
        sinks = {
            f"model.layers.{i}.self_attn.sink": torch.full(
                (config["num_attention_heads_per_layer"][i],), value
            )
            for i in sliding
        }
        loaded = load_model(
            _copy(directory, tmp_path / f"sinks{value}", config, extra=sinks), "f32"
        )
        assert loaded.cfg.layer_sinks == tuple(
            kind == "sliding_attention" for kind in config["layer_types"]
        )
        with torch.no_grad():
            error = compare(loaded.model(ids), theirs)["max_relative_error"]
        assert (error < 1e-4) == matches, (value, error)


@pytest.mark.parametrize(
    "variant, change, message",
    [
        ("llama4_text", {"attention_chunk_size": 0}, "attention_chunk_size is 0"),
        ("llama4_text", {"floor_scale": 0}, "floor_scale is 0"),
        ("mimo_v2_flash", {"swa_num_attention_heads": 8}, "swa_num_attention_heads 8 differs"),
        (
            "mimo_v2_flash",
            {"attention_projection_layout": "interleaved"},
            "attention_projection_layout 'interleaved'",
        ),
        (
            "mimo_v2",
            {"swa_num_key_value_heads": 3},
            "swa_num_key_value_heads 3 or num_attention_heads 4 does not divide",
        ),
        ("laguna", {"moe_router_logit_softcapping": 30.0}, "moe_router_logit_softcapping is 30.0"),
        ("laguna", {"gating": "per-group"}, "gating is 'per-group'"),
        (
            "laguna",
            {"num_attention_heads_per_layer": [4, 3, 8, 4]},
            "layer 1's 3 attention heads do not group",
        ),
    ],
)
def test_configs_it_cannot_run_are_refused_in_one_line(tiny, variant, change, message):
    directory, _ = tiny(variant)
    with pytest.raises(Refusal, match=message) as info:
        from_hf({**read_config(directory), **change})
    assert "\n" not in str(info.value)


def test_a_list_of_sparse_layers_under_moe_layer_freq_is_refused_where_it_is_an_interval(tiny):
    directory, _ = tiny("mimo_v2_flash")
    config = {**read_config(directory), "model_type": "mixtral", "moe_layer_freq": [0, 1, 1, 1]}
    with pytest.raises(Refusal, match="moe_layer_freq lists layers, which mixtral does not read"):
        from_hf(config)


def test_the_merge_writer_puts_each_projection_back_where_mimo_v2s_fused_qkv_holds_it(tiny):
    """MiMo-V2.5's qkv_proj groups rows by the full layers' key-value heads while its sliding layers
    hold twice as many: the rows the writer names for each query, key and value parameter are
    Transformers' own weights."""
    directory, reference = tiny("mimo_v2")
    cfg = from_hf(read_config(directory))
    tensors = load_file(str(directory / "model.safetensors"))
    params = {f"layers.{i}.attn.{p}.weight" for i in range(cfg.num_layers) for p in "qkv"}
    placed = placements(cfg.spec, cfg, sorted(tensors), params)
    assert set(placed) == params
    for param, placement in placed.items():
        i, part = int(param.split(".")[1]), param.split(".")[3]
        fused = tensors[placement.tensor]
        rows = torch.cat([fused[start:stop] for start, stop, _ in placement.runs])
        theirs = getattr(reference.model.layers[i].self_attn, f"{part}_proj").weight
        assert torch.equal(rows, theirs), param
