"""Mistral's own format (params.json + consolidated.safetensors), dense: a tiny Transformers mistral
is converted to it at test time (Mistral's names, query/key rows back in Mistral's native pair
order, the inverse of Transformers' conversion permute), then ster_dist on the converted directory
is compared with Transformers on the original: config, logits and greedy tokens at TP=1 and TP=2 on
real gloo ranks, an adapter merged (written back as consolidated.safetensors) and attached, and the
refusals of the rest."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.adapters.attach import attach
from ster_dist.adapters.format import open_adapter
from ster_dist.adapters.merge import merge
from ster_dist.adapters.targets import sites_for
from ster_dist.config import from_hf
from ster_dist.config.load import model_config
from ster_dist.config.params import from_params
from ster_dist.engine.modifiers import StandingModifiers
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import engine_tokens
from tests.steer.test_merge import ALL7, IDS, peft_adapter, peft_merged
from tests.tiny_models import make_tiny

# both copies share the last path component, as a Hub id and its local copy do
NAME = "tiny-mistral"
_MODULES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Transformers' query/key rows (halves) back in Mistral's native order (adjacent pairs) per
    head."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def mistral_tensors(hf: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A Transformers mistral state dict under Mistral's names and row order."""
    heads = {"wq": config["num_attention_heads"], "wk": config["num_key_value_heads"]}
    out = {}
    for name, tensor in hf.items():
        if name == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = tensor
        elif name == "model.norm.weight":
            out["norm.weight"] = tensor
        elif name == "lm_head.weight":
            out["output.weight"] = tensor
        else:
            layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            native = _MODULES[module]
            kind = native.rsplit(".", 1)[-1]
            out[f"layers.{layer}.{native}.weight"] = (
                to_pairs(tensor, heads[kind]) if kind in heads else tensor
            )
    return {k: v.contiguous() for k, v in out.items()}


def params_json(config: dict) -> dict:
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
        "hidden_dim": config["intermediate_size"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config["num_key_value_heads"],
        "norm_eps": config["rms_norm_eps"],
        "vocab_size": config["vocab_size"],
        "rope_theta": config["rope_parameters"]["rope_theta"],
        "sliding_window": config["sliding_window"],
        "max_seq_len": config["max_position_embeddings"],
        "tied_embeddings": False,
    }


def to_mistral_format(hf_dir: Path, out: Path, weights: Path | None = None) -> None:
    """params.json, consolidated.safetensors and the tokenizer files (no generation_config.json)."""
    out.mkdir(parents=True)
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = {}
    for path in sorted((weights or hf_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    save_file(mistral_tensors(tensors, config), str(out / "consolidated.safetensors"))
    (out / "params.json").write_text(json.dumps(params_json(config)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(hf_dir / name, out / name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(Transformers directory, Mistral-format directory, the Transformers model)."""
    root = tmp_path_factory.mktemp("mistral-format")
    hf_dir, native = root / "hf" / NAME, root / "native" / NAME
    reference = make_tiny("mistral", hf_dir)
    to_mistral_format(hf_dir, native)
    return hf_dir, native, reference


def test_params_json_reads_as_the_transformers_config_rotating_adjacent_pairs(tiny):
    hf_dir, native, _ = tiny
    ours = model_config(resolve(str(native)))
    theirs = model_config(resolve(str(hf_dir)))
    assert ours.weight_format == "mistral" and ours.spec.weight_format == "mistral"
    assert all(r.interleaved for r in ours.layer_rope) and not any(
        r.interleaved for r in theirs.layer_rope
    )
    # tokenizer_config.json's eos_token <|im_end|>
    assert ours.eos_token_ids == theirs.eos_token_ids == (2,)
    # params.json states no bos / pad ids; everything else is the same config
    assert ours == replace(
        theirs,
        weight_format="mistral",
        bos_token_id=None,
        pad_token_id=None,
        torch_dtype=None,
        layer_rope=tuple(replace(r, interleaved=True) for r in theirs.layer_rope),
    )


def test_yarn_and_per_layer_windows_read_as_vllm_reads_them():
    params = {
        "dim": 48,
        "n_layers": 4,
        "n_heads": 4,
        "n_kv_heads": 2,
        "hidden_dim": 80,
        "norm_eps": 1e-5,
        "vocab_size": 300,
        "rope_theta": 1e6,
        "max_position_embeddings": 256,
        "sliding_window": [None, 7],
        "yarn": {"factor": 4.0, "original_max_position_embeddings": 64, "beta": 32.0, "alpha": 1.0},
    }
    ours = from_params(params)
    theirs = from_hf(
        {
            "model_type": "mistral",
            "hidden_size": 48,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 80,
            "rms_norm_eps": 1e-5,
            "vocab_size": 300,
            "max_position_embeddings": 256,
            "sliding_window": 7,
            "layer_types": ["full_attention", "sliding_attention"] * 2,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 64,
                "mscale_all_dim": 1,
            },
        }
    )
    assert ours.layer_window == (None, 7, None, 7)
    assert ours.layer_rope == tuple(replace(r, interleaved=True) for r in theirs.layer_rope)
    assert ours.layer_rope[0].rope_type == "yarn" and ours.layer_rope[0].theta == 1e6


@pytest.fixture(scope="module")
def group():
    with SpawnGroup(2) as g:
        yield g


def test_logits_and_greedy_tokens_equal_transformers_at_tp1_and_tp2(group, tiny):
    _, native, reference = tiny
    checkpoint = resolve(str(native))
    single = load_model(checkpoint, "f32")
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    group.call("load", checkpoint, "f32", "cpu")
    tp2 = group.call("logits", ids)[0]
    with torch.no_grad():
        tp1 = single.model(ids)
        theirs = reference(ids).logits
    for logits in (tp1, tp2):
        report = compare(logits, theirs)
        assert report["max_relative_error"] < 1e-4 and report["mean_cosine"] > 0.9999, report
    prompts = [ids[0, :7].tolist(), ids[1, :4].tolist()]
    eos = single.cfg.eos_token_ids
    ours = engine_tokens(single, prompts, 10, eos)
    assert engine_tokens(group, prompts, 10, eos, checkpoint) == ours
    with torch.no_grad():  # Transformers' greedy continuation of the first prompt, token by token
        tokens = list(prompts[0])
        for _ in range(10):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
            if tokens[-1] in eos:
                break
    assert prompts[0] + ours[0] == tokens


@pytest.fixture(scope="module")
def adapted(tiny, tmp_path_factory):
    """A PEFT adapter on the Transformers model, and PEFT's merged and unmerged logits."""
    hf_dir, _, _ = tiny
    root = tmp_path_factory.mktemp("adapter")
    peft_model = peft_adapter(
        hf_dir, root / NAME, ALL7, r=4, lora_alpha=8, rank_pattern={"k_proj": 2}
    )
    with torch.no_grad():
        unmerged = peft_model(IDS).logits
    merged = peft_merged(peft_model, root / "peft-merged")
    return root / NAME, unmerged, merged


def test_merge_writes_consolidated_safetensors_beside_params_json(tiny, adapted, tmp_path):
    hf_dir, native, _ = tiny
    adapter, unmerged, merged = adapted
    report = merge(str(native), str(adapter), tmp_path / "out")
    files = set(report["files"])
    assert {
        "consolidated.safetensors",
        "params.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    assert "config.json" not in files and not any(
        f.startswith("model") and f.endswith(".safetensors") for f in files
    )
    assert (tmp_path / "out" / "params.json").read_bytes() == (native / "params.json").read_bytes()
    ours = load_file(tmp_path / "out" / "consolidated.safetensors")
    expected = mistral_tensors(merged, json.loads((hf_dir / "config.json").read_text()))
    assert set(ours) == set(expected)
    for name, tensor in ours.items():  # PEFT's merge in Mistral's names and row order, bit for bit
        assert torch.equal(tensor, expected[name]), name
    assert report["merged_tensors"] == 3 * 7
    loaded = load_model(resolve(str(tmp_path / "out")))
    assert loaded.cfg.weight_format == "mistral"
    with torch.no_grad():
        report = compare(loaded.model(IDS), unmerged)
    assert report["max_relative_error"] < 1e-4 and report["mean_cosine"] > 0.9999, report
    sharded = merge(str(native), str(adapter), tmp_path / "sharded", max_shard_size="100KB")
    names = [f for f in sharded["files"] if f.endswith(".safetensors")]
    assert len(names) > 1 and all(f.startswith("consolidated-") for f in names)
    with torch.no_grad():
        again = load_model(resolve(str(tmp_path / "sharded"))).model(IDS)
        assert torch.equal(again, loaded.model(IDS))


def test_runtime_adapter_on_the_mistral_format_equals_peft(group, tiny, adapted):
    _, native, _ = tiny
    adapter, unmerged, _ = adapted
    loaded = load_model(resolve(str(native)))
    sites = sites_for(open_adapter(adapter), loaded.cfg, str(native))
    with torch.no_grad():
        detach = attach(loaded.model, sites)
        tp1 = loaded.model(IDS)
        detach()
    report = compare(tp1, unmerged)
    assert report["max_relative_error"] < 1e-4 and report["mean_cosine"] > 0.9999, report
    group.call("load", resolve(str(native)), "f32", "cpu")
    group.on(StandingModifiers).adapt(
        "t", [{"param": s.param, "a": s.a, "b": s.b, "scale": s.scale} for s in sites]
    )
    tp2 = group.call("logits", IDS)[0]
    group.on(StandingModifiers).detach("t")
    assert compare(tp2, tp1)["max_relative_error"] < 1e-5


_MIXTRAL = {
    "dim": 48,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "hidden_dim": 80,
    "vocab_size": 300,
    "moe": {"num_experts": 4, "num_experts_per_tok": 2},
}
_MIXTRAL_REFUSAL = (
    "describes experts without a shared one (Mixtral's layout) in Mistral's own format, which "
    "ster_dist refuses"
)


# Mistral Large 3 (experts beside a shared one, latent attention) loads:
# tests/families/test_mistral_large3.py
def test_experts_without_a_shared_one_are_refused_in_one_line_before_any_weight(
    tiny, adapted, tmp_path
):
    directory = _params_only(tiny[1], tmp_path / NAME, _MIXTRAL)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(directory)))
    assert _MIXTRAL_REFUSAL in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(Refusal) as refused:
        merge(str(directory), str(adapted[0]), tmp_path / "out")
    assert _MIXTRAL_REFUSAL in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_params_json_of_another_model_type_is_refused(tiny, tmp_path):
    directory = _params_only(
        tiny[1], tmp_path / NAME, {**_MIXTRAL, "moe": None, "model_type": "mamba"}
    )
    with pytest.raises(
        Refusal, match="states model_type 'mamba'; ster_dist reads Mistral's own format for dense"
    ):
        load_model(resolve(str(directory)))


def _params_only(native: Path, directory: Path, params: dict) -> Path:
    """A Mistral-format directory whose weight file cannot be read: a refusal must come before any
    read."""
    directory.mkdir()
    (directory / "params.json").write_text(json.dumps(params))
    shutil.copyfile(native / "tokenizer.json", directory / "tokenizer.json")
    (directory / "consolidated.safetensors").write_bytes(b"never read")
    return directory
