"""LoRA merges against PEFT: merged tensors equal PEFT's merge_and_unload() on tiny bases of the
five layouts (plain, Conv1D, fused head-by-head, fused qkv / gate_up, Granite 4.0's shared_mlp) with
rsLoRA and rank / alpha patterns; Ster-format adapters land on the rows their projections live in;
the merged directory loads in Transformers with PEFT's logits; a killed merge leaves no output and
resumes; peak memory stays a small multiple of the largest tensor; a batch merges over a local Ray
cluster; every refusal names its problem before weights are read."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.adapters.merge import merge, prepare, write_one
from ster_dist.cli import main
from ster_dist.errors import Refusal
from tests.tiny_models import make_tiny

REPO = Path(__file__).resolve().parents[2]
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# family -> (PEFT target_modules, LoraConfig arguments): rsLoRA and rank / alpha patterns across
# them
PEFT_CASES = {
    "llama": (
        ALL7,
        {
            "r": 4,
            "lora_alpha": 8,
            "use_rslora": True,
            "rank_pattern": {"k_proj": 2, "layers.1.mlp.down_proj": 6},
            "alpha_pattern": {"o_proj": 3.0},
        },
    ),
    "qwen2": (ALL7, {"r": 3, "lora_alpha": 5}),
    "gpt2": (["c_attn", "c_proj", "c_fc"], {"r": 4, "lora_alpha": 16, "rank_pattern": {"c_fc": 2}}),
    "gpt_neox": (
        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
        {"r": 4, "lora_alpha": 8, "use_rslora": True, "alpha_pattern": {"dense_4h_to_h": 2.0}},
    ),
    "phi3": (
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        {
            "r": 4,
            "lora_alpha": 8,
            "use_rslora": True,
            "rank_pattern": {"qkv_proj": 6},
            "alpha_pattern": {"gate_up_proj": 2.0},
        },
    ),
    # Granite 4.0 without experts: its shared_mlp (gate and up fused in input_linear) is the dense
    # feed-forward
    "granitemoehybrid_dense": (
        ["q_proj", "o_proj", "input_linear", "output_linear"],
        {"r": 4, "lora_alpha": 8},
    ),
}
IDS = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def peft_adapter(
    base: Path, out: Path, targets, seed: int = 1, dtype=torch.float32, factors=None, **lora
):
    """A PEFT LoRA model over the base with random (or given) factors, saved to `out`; returns the
    model."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    peft_model = get_peft_model(model, LoraConfig(target_modules=targets, **lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                key = name.replace("base_model.model.", "").replace(".default", "")
                value = (
                    factors[key]
                    if factors is not None and key in factors
                    else torch.randn(p.shape, generator=gen) * 0.1
                )
                p.copy_(value.to(p.dtype))
    peft_model.save_pretrained(out)
    return peft_model.eval()


def peft_merged(peft_model, directory: Path) -> dict[str, torch.Tensor]:
    """PEFT's merge_and_unload(), saved as Transformers saves it: the tensors under the checkpoint's
    names."""
    peft_model.merge_and_unload().save_pretrained(directory, safe_serialization=True)
    return read_dir(directory)


def read_dir(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(path))
    return out


def max_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", sorted(PEFT_CASES))
def test_merge_equals_peft_merge_and_unload(tmp_path, family):
    import transformers

    make_tiny(family, tmp_path / "base")
    targets, lora = PEFT_CASES[family]
    peft_model = peft_adapter(tmp_path / "base", tmp_path / "adapter", targets, **lora)
    with torch.no_grad():
        unmerged = peft_model(IDS).logits
    report = merge(
        str(tmp_path / "base"), str(tmp_path / "adapter"), tmp_path / "out", max_shard_size="60KB"
    )
    reference = peft_merged(peft_model, tmp_path / "peft-merged")
    source, ours = read_dir(tmp_path / "base"), read_dir(tmp_path / "out")
    assert set(ours) == set(source)
    for name, tensor in ours.items():  # PEFT accumulates f32 bases in f32 too: bit for bit
        assert torch.equal(tensor, reference[name]), name
    merged = {n for n in ours if not torch.equal(ours[n], source[n])}
    assert report["merged_tensors"] == len(merged) > 0
    assert (
        report["copied_tensors"] + report["merged_tensors"]
        == report["total_tensors"]
        == len(source)
    )
    assert report["shards"] > 1 and report["dtype"] == "F32" and report["layers"] == [0, 1, 2]
    assert report["scale"] == pytest.approx(
        lora["lora_alpha"] / (math.sqrt(lora["r"]) if lora.get("use_rslora") else lora["r"])
    )
    with torch.no_grad():
        logits = (
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(IDS).logits
        )
    assert max_relative(logits, unmerged) < 1e-5


def test_bf16_base_is_merged_in_f32_and_stays_bf16(tmp_path):
    make_tiny("llama", tmp_path / "base", dtype=torch.bfloat16)
    peft_model = peft_adapter(
        tmp_path / "base", tmp_path / "adapter", ALL7, dtype=torch.bfloat16, r=4, lora_alpha=8
    )
    report = merge(str(tmp_path / "base"), str(tmp_path / "adapter"), tmp_path / "out")
    source, ours = read_dir(tmp_path / "base"), read_dir(tmp_path / "out")
    factors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    a = factors[f"base_model.model.{name[:-7]}.lora_A.weight"].float()
    b = factors[f"base_model.model.{name[:-7]}.lora_B.weight"].float()
    # one rounding: the f32 sum cast back, never a bf16 delta added in bf16
    assert torch.equal(ours[name], (source[name].float() + (b @ a) * 2.0).to(torch.bfloat16))
    assert report["dtype"] == "BF16" and all(t.dtype == torch.bfloat16 for t in ours.values())
    # PEFT rounds the delta first: within one ulp
    reference = peft_merged(peft_model, tmp_path / "peft-merged")[name]
    assert (
        (ours[name].float() - reference.float()).abs() <= reference.float().abs() * 2**-7 + 1e-6
    ).all()


# ---- Ster's format: factors per decoder projection, placed by the name map ----------------------


def _rows(family: str, cfg: dict) -> dict[str, dict[str, list[int]]]:
    """Fused module -> target -> its rows, written out from each layout's documentation (not our
    map)."""
    h = cfg.get("hidden_size") or cfg["n_embd"]
    heads = cfg.get("num_attention_heads") or cfg["n_head"]
    kv = cfg.get("num_key_value_heads") or heads
    d = h // heads
    if family == "phi3":
        inner = cfg["intermediate_size"]
        q, k = heads * d, kv * d
        return {
            "self_attn.qkv_proj": {
                "query": list(range(q)),
                "key": list(range(q, q + k)),
                "value": list(range(q + k, q + 2 * k)),
            },
            "mlp.gate_up_proj": {"gate": list(range(inner)), "up": list(range(inner, 2 * inner))},
        }
    if family == "gpt2":
        return {
            "attn.c_attn": {
                t: list(range(i * h, (i + 1) * h)) for i, t in enumerate(("query", "key", "value"))
            }
        }
    # GPT-NeoX: head by head, each head's query, key and value rows in turn
    return {
        "attention.query_key_value": {
            t: [3 * d * j + i * d + x for j in range(heads) for x in range(d)]
            for i, t in enumerate(("query", "key", "value"))
        }
    }


# family -> (Ster targets, PEFT modules of the equivalent adapter, plain target -> module)
STER_CASES = {
    "phi3": (
        ["query", "key", "value", "output", "gate", "up", "down"],
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        {"output": "self_attn.o_proj", "down": "mlp.down_proj"},
    ),
    "gpt2": (
        ["query", "key", "value", "output", "up", "down"],
        ["c_attn", "c_proj", "c_fc"],
        {"output": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"},
    ),
    "gpt_neox": (
        ["query", "key", "value", "output", "up", "down"],
        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
        {"output": "attention.dense", "up": "mlp.dense_h_to_4h", "down": "mlp.dense_4h_to_h"},
    ),
}
_PREFIX = {
    "phi3": "model.layers.{i}.",
    "gpt2": "transformer.h.{i}.",
    "gpt_neox": "gpt_neox.layers.{i}.",
}


def ster_adapter(
    path: Path, base: Path, targets, layers, rank=3, alpha=6.0, seed=2, **sidecar
) -> dict:
    """A Ster adapter (layers.{l}.{target}.a/.b + sidecar) with random factors shaped for the
    base."""
    from ster_dist.adapters.targets import PARAMS, decoder_shards
    from ster_dist.config.load import model_config
    from ster_dist.resolve import resolve

    cfg = model_config(resolve(str(base)))
    shards = decoder_shards(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        for target in targets:
            outputs, inputs = shards[f"layers.0.{PARAMS[target]}.weight"].global_shape
            tensors[f"layers.{layer}.{target}.a"] = torch.randn(rank, inputs, generator=gen) * 0.2
            tensors[f"layers.{layer}.{target}.b"] = torch.randn(outputs, rank, generator=gen) * 0.2
    save_file(tensors, str(path))
    document = {
        "schema_version": 1,
        "product": "ster",
        "kind": "adapter",
        "model": str(base),
        "model_revision": None,
        "rank": rank,
        "alpha": alpha,
        "targets": list(targets),
        "layers": list(layers),
        "hidden_size": cfg.hidden_size,
        "train": {"chat_template": "off"},
        **sidecar,
    }
    path.with_suffix(".json").write_text(json.dumps(document))
    return tensors


def ster_as_peft(family: str, base: Path, tensors: dict, layers, rank: int, alpha: float) -> dict:
    """The same update as a PEFT adapter: each fused module's factors stacked, its B block-diagonal
    by rows."""
    cfg = json.loads((base / "config.json").read_text())
    targets, _, plain = STER_CASES[family]
    factors = {}
    for layer in layers:
        prefix = _PREFIX[family].format(i=layer)
        for module, parts in _rows(family, cfg).items():
            present = [t for t in parts if t in targets]
            a = torch.cat([tensors[f"layers.{layer}.{t}.a"] for t in present])
            b = torch.zeros(sum(len(r) for r in parts.values()), rank * len(present))
            for k, t in enumerate(present):
                b[parts[t], k * rank : (k + 1) * rank] = tensors[f"layers.{layer}.{t}.b"]
            (
                factors[f"{prefix}{module}.lora_A.weight"],
                factors[f"{prefix}{module}.lora_B.weight"],
            ) = a, b
        for target, module in plain.items():
            factors[f"{prefix}{module}.lora_A.weight"] = tensors[f"layers.{layer}.{target}.a"]
            factors[f"{prefix}{module}.lora_B.weight"] = tensors[f"layers.{layer}.{target}.b"]
    return factors


@pytest.mark.parametrize("family", sorted(STER_CASES))
def test_ster_adapter_merges_into_fused_rows_where_they_live(tmp_path, family):
    import transformers

    make_tiny(family, tmp_path / "base")
    targets, modules, _ = STER_CASES[family]
    layers, rank, alpha = [0, 2], 3, 6.0
    tensors = ster_adapter(
        tmp_path / "calm.safetensors", tmp_path / "base", targets, layers, rank, alpha
    )
    factors = ster_as_peft(family, tmp_path / "base", tensors, layers, rank, alpha)
    # a fused module stacks n projections' factors: rank n * r at alpha n * alpha keeps the scale
    # alpha / r
    stacked = {
        m.split(".")[-1]: len([t for t in targets if t in parts])
        for m, parts in _rows(
            family, json.loads((tmp_path / "base" / "config.json").read_text())
        ).items()
    }
    peft_model = peft_adapter(
        tmp_path / "base",
        tmp_path / "peft",
        modules,
        factors=factors,
        r=rank,
        lora_alpha=alpha,
        layers_to_transform=layers,
        rank_pattern={m: rank * n for m, n in stacked.items()},
        alpha_pattern={m: alpha * n for m, n in stacked.items()},
    )
    with torch.no_grad():
        unmerged = peft_model(IDS).logits
    report = merge(str(tmp_path / "base"), str(tmp_path / "calm.safetensors"), tmp_path / "out")
    assert (
        report["format"] == "ster" and report["layers"] == layers and report["targets"] == targets
    )
    reference = peft_merged(peft_model, tmp_path / "peft-merged")
    source, ours = read_dir(tmp_path / "base"), read_dir(tmp_path / "out")
    for name, tensor in ours.items():
        assert max_relative(tensor, reference[name]) < 1e-6, name
    changed = {n for n in ours if not torch.equal(ours[n], source[n])}
    assert (
        report["merged_tensors"]
        == len(changed)
        == len(layers) * (len(stacked) + len(STER_CASES[family][2]))
    )
    with torch.no_grad():
        logits = (
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(IDS).logits
        )
    assert max_relative(logits, unmerged) < 1e-5


# ---- the command, its report and its files -----------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    make_tiny("llama", root / "base")
    peft_adapter(root / "base", root / "adapter", ALL7, r=4, lora_alpha=8)
    return root


def test_cli_writes_an_ordinary_checkpoint_and_reports_it(llama, tmp_path, capsys):
    out = tmp_path / "merged"
    code = main(
        [
            "merge",
            "--model",
            str(llama / "base"),
            "--adapter",
            str(llama / "adapter"),
            "--output",
            str(out),
            "--revision",
            "v1",
            "--max-shard-size",
            "100KB",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in (
        "model",
        "model_revision",
        "adapter",
        "output",
        "rank",
        "alpha",
        "scale",
        "targets",
        "layers",
        "merged_tensors",
        "copied_tensors",
        "total_tensors",
        "dtype",
        "files",
    ):
        assert key in report, key
    assert report["model_revision"] == "v1" and report["rank"] == 4 and report["scale"] == 2.0
    assert report["targets"] == ["query", "key", "value", "output", "gate", "up", "down"]
    assert sorted(report["files"]) == sorted(p.name for p in out.iterdir())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert (
        len(shards) == report["shards"] > 1 and sorted(set(index["weight_map"].values())) == shards
    )
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in read_dir(out).values()
    )
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / name).read_bytes() == (llama / "base" / name).read_bytes(), name
    assert not list(tmp_path.glob(".*merging"))  # the work directory was renamed into place


def _write_gguf_dir(directory: Path, base: Path) -> None:
    directory.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (directory / name).write_bytes((base / name).read_bytes())
    (directory / "model.gguf").write_bytes(b"GGUF")  # never read: the refusal comes first


def _refusal_cases(llama: Path, tmp: Path) -> dict:
    """name -> (model dir, adapter path, expected message)."""
    base, adapter = llama / "base", llama / "adapter"
    cases = {}
    anon = tmp / "anon"  # the same adapter not naming its base, for bases in other directories
    anon.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    (anon / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": None})
    )
    (anon / "adapter_model.safetensors").write_bytes(
        (adapter / "adapter_model.safetensors").read_bytes()
    )
    _write_gguf_dir(tmp / "gguf", base)
    cases["gguf base"] = (
        tmp / "gguf",
        anon,
        "is a GGUF checkpoint; an adapter is merged into safetensors",
    )
    ster_adapter(tmp / "other.safetensors", base, ["query"], [0], model="someone/else")
    cases["another model"] = (
        base,
        tmp / "other.safetensors",
        'adapter was trained for model "someone/else"',
    )
    ster_adapter(tmp / "wide.safetensors", base, ["query"], [0], hidden_size=64)
    cases["another width"] = (
        base,
        tmp / "wide.safetensors",
        "adapter width 64 does not match model width 48",
    )
    (tmp / "gpt2").mkdir()
    make_tiny("gpt2", tmp / "gpt2")
    tensors = ster_adapter(tmp / "g.safetensors", tmp / "gpt2", ["up"], [0])
    tensors["layers.0.gate.a"], tensors["layers.0.gate.b"] = (
        tensors["layers.0.up.a"] + 0,
        tensors["layers.0.up.b"] + 0,
    )
    save_file(tensors, str(tmp / "g.safetensors"))
    sidecar = json.loads((tmp / "g.json").read_text())
    (tmp / "g.json").write_text(json.dumps({**sidecar, "targets": ["up", "gate"]}))
    cases["gate on a plain feed-forward"] = (
        tmp / "gpt2",
        tmp / "g.safetensors",
        "feed-forward is plain (no gate)",
    )
    (tmp / "V.json").write_text(
        json.dumps(
            {
                "schema_version": 1,
                "trait_name": "calm",
                "layers": [{"layer": 1, "vector": [0.0] * 48}],
            }
        )
    )
    cases["a vector as an adapter"] = (
        base,
        tmp / "V.json",
        "is a steering artifact, not a LoRA adapter sidecar",
    )
    ster_adapter(tmp / "deep.safetensors", base, ["query"], [7])
    cases["a layer the model lacks"] = (
        base,
        tmp / "deep.safetensors",
        "layer 7 is outside the model's 0..2 range",
    )
    (tmp / "mamba").mkdir()
    (tmp / "mamba" / "config.json").write_text(
        json.dumps({"model_type": "mamba", "hidden_size": 48})
    )
    (tmp / "mamba" / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    save_file(
        {"backbone.embeddings.weight": torch.zeros(4, 48)}, str(tmp / "mamba" / "model.safetensors")
    )
    cases["a state-space family"] = (
        tmp / "mamba",
        anon,
        "adapters on mamba are refused: its state-space layers",
    )
    twice = tmp / "twice"
    twice.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (twice / name).write_bytes((base / name).read_bytes())
    weights = read_dir(base)
    save_file(weights, str(twice / "model-1.safetensors"))
    save_file(
        {"model.norm.weight": weights["model.norm.weight"]}, str(twice / "model-2.safetensors")
    )
    cases["a tensor named in two files"] = (
        twice,
        anon,
        "model weight model.norm.weight appears in more than one",
    )
    dora = tmp / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(
        (adapter / "adapter_model.safetensors").read_bytes()
    )
    cases["a DoRA adapter"] = (base, dora, "it is a DoRA adapter")
    pickled = tmp / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps(config))
    (pickled / "adapter_model.bin").write_bytes(b"not read")
    cases["a pickled adapter"] = (
        base,
        pickled,
        "holds only pickled weights (adapter_model.bin), which ster_dist never",
    )
    return cases


def test_refusals_name_the_problem_and_write_nothing(llama, tmp_path, capsys):
    cases = _refusal_cases(llama, tmp_path)
    for what, (model, adapter, message) in cases.items():
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        code = main(
            ["merge", "--model", str(model), "--adapter", str(adapter), "--output", str(out)]
        )
        captured = capsys.readouterr()
        assert code == 2, (what, captured.err)
        assert message in captured.err, (what, captured.err)
        assert "Traceback" not in captured.err and captured.out == ""
        assert not out.exists() and not list(tmp_path.glob(f".{out.name}.merging")), what


def test_a_side_file_linking_out_of_the_model_directory_is_refused_before_anything_is_written(
    llama, tmp_path, capsys
):
    """Issue 19: a merge copied a symlinked tokenizer_config.json's target (any file the user can
    read) into its output."""
    secret = tmp_path / "elsewhere" / "secret"
    secret.parent.mkdir()
    secret.write_text("not the model's")
    base = tmp_path / "base"
    base.mkdir()
    for item in (llama / "base").iterdir():
        if item.name != "tokenizer_config.json":
            (base / item.name).write_bytes(item.read_bytes())
    (base / "tokenizer.json").rename(base / "tokenizer.real.json")
    # a link within the directory is fine
    (base / "tokenizer.json").symlink_to("tokenizer.real.json")
    (base / "tokenizer_config.json").symlink_to(secret)
    out = tmp_path / "merged"
    code = main(
        ["merge", "--model", str(base), "--adapter", str(llama / "adapter"), "--output", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert (
        f"{base / 'tokenizer_config.json'} is a symlink to {secret}, outside the model directory"
        in err
    )
    assert not out.exists() and not list(tmp_path.glob(".merged.merging"))


@pytest.mark.parametrize("into", ["base", "adapter"])
def test_a_merge_into_the_model_or_the_adapter_directory_is_refused(llama, capsys, into):
    out = llama / into / "merged"
    code = main(
        [
            "merge",
            "--model",
            str(llama / "base"),
            "--adapter",
            str(llama / "adapter"),
            "--output",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"--output {out} is inside" in err and "write somewhere else" in err, err
    assert not out.exists() and not list((llama / into).glob(".merged.merging"))


def test_a_tensor_named_twice_in_one_header_is_refused(llama, tmp_path):
    from ster_dist.adapters.merge import index_weights

    path = tmp_path / "model.safetensors"
    header = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(Refusal, match="model weight a appears twice in model.safetensors"):
        index_weights([path])


def test_an_existing_output_is_refused(llama, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(Refusal, match="already exists"):
        merge(str(llama / "base"), str(llama / "adapter"), tmp_path / "out")


def test_feed_forward_targets_on_experts_are_refused(tmp_path):
    from ster_dist.families.registry import spec_for

    if spec_for("mixtral") is None:
        pytest.skip("no mixture-of-experts family in this build yet")
    import transformers

    from tests.tiny_models import TINY

    if "mixtral" not in TINY:
        pytest.skip("no tiny mixtral in tests/tiny_models.py yet")
    make_tiny("mixtral", tmp_path / "base")
    ster_adapter(tmp_path / "a.safetensors", tmp_path / "base", ["query"], [0])
    sidecar = json.loads((tmp_path / "a.json").read_text())
    tensors = load_file(tmp_path / "a.safetensors")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "base")
    tensors["layers.0.up.a"] = torch.zeros(3, cfg.hidden_size)
    tensors["layers.0.up.b"] = torch.zeros(cfg.intermediate_size, 3)
    save_file(tensors, str(tmp_path / "a.safetensors"))
    (tmp_path / "a.json").write_text(json.dumps({**sidecar, "targets": ["query", "up"]}))
    with pytest.raises(Refusal, match="sit on attention only"):
        merge(str(tmp_path / "base"), str(tmp_path / "a.safetensors"), tmp_path / "out")


# ---- a few-hundred-MB checkpoint: memory, kill and resume ---------------------------------------


def _big_llama(directory: Path, hidden=1024, layers=6, inner=2816, vocab=32001, rank=16) -> dict:
    """About 550 MB of f32 llama weights in two files, and a PEFT adapter on every projection."""
    heads, kv = 16, 8
    d = hidden // heads
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inner,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen),
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen),
        "model.norm.weight": torch.ones(hidden),
    }
    shapes = {
        "self_attn.q_proj": (heads * d, hidden),
        "self_attn.k_proj": (kv * d, hidden),
        "self_attn.v_proj": (kv * d, hidden),
        "self_attn.o_proj": (hidden, heads * d),
        "mlp.gate_proj": (inner, hidden),
        "mlp.up_proj": (inner, hidden),
        "mlp.down_proj": (hidden, inner),
    }
    factors = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            tensors[f"{p}{name}.weight"] = torch.randn(shape, generator=gen) * 0.02
            factors[f"base_model.model.{p}{name}.lora_A.weight"] = (
                torch.randn(rank, shape[1], generator=gen) * 0.01
            )
            factors[f"base_model.model.{p}{name}.lora_B.weight"] = (
                torch.randn(shape[0], rank, generator=gen) * 0.01
            )
        tensors[f"{p}input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{p}post_attention_layernorm.weight"] = torch.ones(hidden)
    base = directory / "base"
    base.mkdir()
    names = sorted(tensors)
    save_file(
        {n: tensors[n] for n in names[: len(names) // 2]},
        str(base / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {n: tensors[n] for n in names[len(names) // 2 :]},
        str(base / "model-00002-of-00002.safetensors"),
    )
    (base / "config.json").write_text(json.dumps(cfg))
    from tests.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(base)
    adapter = directory / "adapter"
    adapter.mkdir()
    save_file(factors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 32,
                "target_modules": ALL7,
                "bias": "none",
                "base_model_name_or_path": str(base),
            }
        )
    )
    return {
        "total": sum(t.numel() * 4 for t in tensors.values()),
        "largest": max(t.numel() * 4 for t in tensors.values()),
        "largest_adapted": max(math.prod(s) * 4 for s in shapes.values()),
    }


_MEASURED_MERGE = textwrap.dedent("""
    import json, sys
    from ster_dist.adapters.merge import merge
    # what a first use costs once per process, paid before the mark because it is not the merge's
    # memory: the modules the merge imports lazily, and torch's first matmul (its thread pool)
    import torch, ster_dist.atomic, ster_dist.config.params, ster_dist.config.load, ster_dist.load, ster_dist.resolve
    torch.ones(64, 64) @ torch.ones(64, 64)
    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark from here on
    before = status("VmRSS")
    report = merge(sys.argv[1], sys.argv[2], sys.argv[3], max_shard_size=sys.argv[4])
    print(json.dumps({"growth": status("VmHWM") - before, "report": report}))
""")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    sizes = _big_llama(root)
    out = root / "fresh"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _MEASURED_MERGE,
            str(root / "base"),
            str(root / "adapter"),
            str(out),
            "40MB",
        ],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return root, sizes, json.loads(run.stdout.strip().splitlines()[-1])


def test_peak_memory_is_a_small_multiple_of_the_largest_tensor(big):
    root, sizes, measured = big
    assert sizes["total"] > 250e6
    report = measured["report"]
    assert report["merged_tensors"] == 42 and report["shards"] >= 7
    # the embedding and head (131 MB each) are copied without entering the process, adapted
    # tensors (11.5 MB at most) pass through in 8 MB row blocks: measured 36 MB, adapter included
    assert measured["growth"] < sizes["largest"] / 2, (
        f"peak RSS grew by {measured['growth'] / 1e6:.0f} MB"
    )
    assert measured["growth"] < 0.1 * sizes["total"], (
        f"peak RSS grew by {measured['growth'] / 1e6:.0f} MB"
    )
    source, ours = read_dir(root / "base"), read_dir(root / "fresh")
    factors = load_file(root / "adapter" / "adapter_model.safetensors")
    name = "model.layers.3.mlp.down_proj"
    delta = (
        factors[f"base_model.model.{name}.lora_B.weight"]
        @ factors[f"base_model.model.{name}.lora_A.weight"]
    ) * 2.0
    assert torch.equal(ours[f"{name}.weight"], source[f"{name}.weight"] + delta)
    assert torch.equal(ours["model.embed_tokens.weight"], source["model.embed_tokens.weight"])


def test_a_killed_merge_leaves_no_output_and_a_rerun_completes_it(big, tmp_path):
    root, _, measured = big
    out = tmp_path / "merged"
    work = tmp_path / ".merged.merging"
    argv = [
        sys.executable,
        "-m",
        "ster_dist.cli",
        "merge",
        "--model",
        str(root / "base"),
        "--adapter",
        str(root / "adapter"),
        "--output",
        str(out),
        "--max-shard-size",
        "40MB",
    ]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while (
        not list(work.glob("model-*.safetensors"))
        and time.monotonic() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = sorted(p.name for p in work.glob("model-*.safetensors"))
    assert finished and len(finished) < measured["report"]["shards"], finished
    assert not out.exists()
    report = merge(str(root / "base"), str(root / "adapter"), out, max_shard_size="40MB")
    assert report["resumed_shards"] == len(finished)
    assert not work.exists()
    fresh = root / "fresh"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    # resumed, byte for byte what one uninterrupted merge wrote
    for path in out.glob("*.safetensors"):
        assert path.read_bytes() == (fresh / path.name).read_bytes(), path.name


# ---- batches over a local Ray cluster -----------------------------------------------------------


def test_a_batch_of_merges_over_local_ray_produces_every_output(llama, tmp_path):
    import importlib.util

    ray = pytest.importorskip("ray")
    spec = importlib.util.spec_from_file_location("jobs_merge", REPO / "jobs" / "merge.py")
    jobs_merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jobs_merge)

    make_tiny("phi3", tmp_path / "phi3")
    peft_adapter(
        tmp_path / "phi3",
        tmp_path / "phi3-adapter",
        ["qkv_proj", "gate_up_proj"],
        r=2,
        lora_alpha=4,
    )
    ster_adapter(tmp_path / "calm.safetensors", llama / "base", ["query", "down"], [1, 2])
    merges = [
        {
            "model": str(llama / "base"),
            "adapter": str(llama / "adapter"),
            "output": str(tmp_path / "a"),
        },
        {
            "model": str(llama / "base"),
            "adapter": str(tmp_path / "calm.safetensors"),
            "output": str(tmp_path / "b"),
        },
        {
            "model": str(tmp_path / "phi3"),
            "adapter": str(tmp_path / "phi3-adapter"),
            "output": str(tmp_path / "c"),
        },
    ]
    # the first merge was killed after one shard: the batch finishes the rest
    plan = prepare(
        merges[0]["model"], merges[0]["adapter"], merges[0]["output"], max_shard_size="50KB"
    )
    write_one(plan, 0)
    events = []
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        result = jobs_merge.batch_merge(
            {"merges": merges, "max_shard_size": "50KB"}, lambda m, **f: events.append((m, f))
        )
    finally:
        ray.shutdown()
    assert result["merged"] == 3 and result["failed"] == 0 and result["bases"] == 2
    assert result["shards_resumed"] == 1 and result["merges"][0]["report"]["resumed_shards"] == 1
    assert sum(1 for m, _ in events if m.startswith("wrote")) == result["shards_written"] > 3
    for item in merges:  # each equals the same merge done in one process
        alone = tmp_path / (Path(item["output"]).name + "-alone")
        merge(item["model"], item["adapter"], alone, max_shard_size="50KB")
        for path in alone.iterdir():
            assert path.read_bytes() == (Path(item["output"]) / path.name).read_bytes(), path


@pytest.mark.slow
def test_jobs_merge_runs_under_ray_job_submit(llama, tmp_path):
    """`ray job submit -- python jobs/merge.py SPEC` against a head node this test starts (and stops
    by its own process, never `ray stop`, which would stop every Ray cluster of the machine)."""
    from ster_dist.workers.rank import free_port

    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "merges": [
                    {
                        "model": str(llama / "base"),
                        "adapter": str(llama / "adapter"),
                        "output": str(tmp_path / "out"),
                    }
                ],
                "max_shard_size": "60KB",
            }
        )
    )
    import shutil
    import tempfile

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    ray_tmp = tempfile.mkdtemp(prefix="rm", dir="/tmp")  # short: Ray's socket paths live below it
    port, dashboard = free_port("127.0.0.1"), free_port("127.0.0.1")
    ray_cli = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={ray_tmp}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        submit = None
        for _ in range(60):  # the job server answers a few seconds after the head starts
            assert head.poll() is None, "the Ray head exited"
            submit = subprocess.run(
                [
                    ray_cli,
                    "job",
                    "submit",
                    "--address",
                    f"http://127.0.0.1:{dashboard}",
                    "--",
                    sys.executable,
                    str(REPO / "jobs" / "merge.py"),
                    str(spec),
                ],
                check=False,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if (
                submit.returncode == 0
                or "succeeded" in submit.stdout
                or (tmp_path / "out").exists()
            ):
                break
            time.sleep(2)
        assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
        assert "succeeded" in submit.stdout + submit.stderr
    finally:
        head.send_signal(signal.SIGINT)  # --block stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    alone = tmp_path / "alone"
    merge(str(llama / "base"), str(llama / "adapter"), alone, max_shard_size="60KB")
    for path in alone.iterdir():
        assert path.read_bytes() == (tmp_path / "out" / path.name).read_bytes(), path
