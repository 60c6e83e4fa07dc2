"""Capture of residual-stream hidden states: equal to Transformers' hidden states after the same
layer (left-padded batches, last and all positions) at one rank and at TP=2 on a real gloo group,
and `ster extract` streaming them to a safetensors file that appears only when whole."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from ster_dist.cli import main
from ster_dist.errors import Refusal
from ster_dist.resolve import resolve
from ster_dist.steer.capture import capture, read_hidden
from ster_dist.steer.layers import parse_layers
from ster_dist.steer.store import StreamedSafetensors
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.group import LocalGroup
from ster_dist.workers.spawn import SpawnGroup
from tests.tiny_models import make_tiny

PROMPTS = [
    "hello there",
    "the sea is calm and quiet tonight .",
    "What is the capital of France?",
    "a gentle breeze",
    "Tensor parallel attention splits heads; expert parallel layers route tokens.",
]


def hf_layers(model):
    """The decoder-layer list of a Transformers causal LM, whatever the family names it."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise AssertionError(f"no decoder layers found in {type(model).__name__}")


@torch.no_grad()
def hf_residual(model, ids: list[int]) -> list[torch.Tensor]:
    """Transformers' residual after every decoder layer for one unpadded prompt: hidden_states[i +
    1] for all but the last layer (whose entry is after the final norm), a forward hook for the
    last."""
    layers = hf_layers(model)
    last = {}
    handle = layers[-1].register_forward_hook(
        lambda m, a, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    return [h[0] for h in out.hidden_states[1 : len(layers)]] + [last["h"][0]]


@pytest.fixture(scope="module", params=["llama", "gemma2", "gpt2", "qwen3_moe"])
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = make_tiny(request.param, directory)
    tokenizer = Tokenizer.from_directory(directory)
    encoded = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_residual(reference, ids) for ids in encoded]
    return directory, encoded, expected


@pytest.fixture(scope="module")
def group():
    with SpawnGroup(2) as g:
        yield g


def _check(rows_last, rows_all, encoded, expected, layers):
    lengths = [len(ids) for ids in encoded]
    for layer in layers:
        want_last = torch.stack([e[layer][-1] for e in expected])
        want_all = torch.cat([e[layer] for e in expected])
        assert rows_last[layer].shape == want_last.shape and rows_all[layer].shape == (
            sum(lengths),
            want_all.shape[1],
        )
        assert torch.allclose(rows_last[layer], want_last, rtol=1e-4, atol=1e-4), layer
        assert torch.allclose(rows_all[layer], want_all, rtol=1e-4, atol=1e-4), layer


def _read(group, encoded, layers, positions, batch_size):
    parts = {layer: [] for layer in layers}
    for _, rows in capture(group, encoded, layers, positions, 0, batch_size):
        for layer in layers:
            parts[layer].append(rows[layer])
    return {layer: torch.cat(p) for layer, p in parts.items()}


def test_capture_equals_transformers_hidden_states_at_one_rank(tiny):
    directory, encoded, expected = tiny
    layers = [0, 1, 2]
    with LocalGroup() as local:
        local.call("load", resolve(str(directory)), "f32", "cpu")
        rows_last = _read(local, encoded, layers, "last", 2)  # left-padded batches of two
        rows_all = _read(local, encoded, layers, "all", 3)
    _check(rows_last, rows_all, encoded, expected, layers)


def test_capture_at_tp2_equals_transformers_and_one_rank(tiny, group):
    directory, encoded, expected = tiny
    group.call("load", resolve(str(directory)), "f32", "cpu")
    layers = [0, 2]
    rows_last = _read(group, encoded, layers, "last", 5)
    rows_all = _read(group, encoded, layers, "all", 2)
    _check(rows_last, rows_all, encoded, expected, layers)


def test_capture_on_a_mixture_of_experts_at_ep2_equals_transformers(tmp_path):
    """Experts split over two expert-parallel ranks (tokens dispatched all-to-all); the residual is
    the same on both, and rank 0's read equals Transformers'."""
    reference = make_tiny("mixtral", tmp_path)
    tokenizer = Tokenizer.from_directory(tmp_path)
    encoded = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_residual(reference, ids) for ids in encoded]
    with SpawnGroup(2, ep=2) as ep2:
        ep2.call("load", resolve(str(tmp_path)), "f32", "cpu")
        rows_last = _read(ep2, encoded, [0, 2], "last", 2)
        rows_all = _read(ep2, encoded, [0, 2], "all", 5)
    _check(rows_last, rows_all, encoded, expected, [0, 2])


def test_capture_stops_after_the_deepest_layer_and_leaves_no_hook(llama):
    from ster_dist.load import load_model

    directory, _ = llama
    model = load_model(resolve(str(directory))).model
    ran = []
    model.final_norm.register_forward_hook(lambda *a: ran.append(1))
    rows = read_hidden(model, [[5, 6, 7], [8]], [0], "last")
    assert rows[0].shape == (2, model.cfg.hidden_size) and not ran  # no later layer, no head
    assert all(not hooks for hooks in model.hooks.values())
    model(torch.tensor([[5, 6]]))
    assert ran  # and the model still runs whole afterwards


def test_layer_selection_grammar_and_refusals():
    assert parse_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layers("5,3,3..6", 8) == [3, 4, 5]
    assert parse_layers("1..3", 4) == [1, 2]
    for spec, message in [
        ("x", 'invalid layer "x"'),
        ("8..x", 'invalid layer range "8..x"'),
        ("8..8", 'layer range "8..8" must have start < end'),
        (" , ", "no layers selected"),
        ("4", "layer 4 is outside the model's 0..3 range"),
    ]:
        with pytest.raises(Refusal, match=message):
            parse_layers(spec, 4)


def test_a_failed_stream_leaves_no_file(tmp_path):
    target = tmp_path / "acts.safetensors"
    with (
        pytest.raises(RuntimeError),
        StreamedSafetensors(target, {"x": (torch.float32, (4, 3))}, {}) as store,
    ):
        store.write_rows("x", 0, torch.ones(2, 3))
        raise RuntimeError("a rank died")
    assert os.listdir(tmp_path) == []
    with (
        pytest.raises(ValueError, match="not fully written"),
        StreamedSafetensors(target, {"x": (torch.float32, (4, 3))}, {}) as store,
    ):
        store.write_rows("x", 0, torch.ones(2, 3))
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_cli")
    reference = make_tiny("llama", directory)
    return directory, reference


def test_extract_streams_batches_to_safetensors_with_metadata(llama, tmp_path, capsys):
    directory, reference = llama
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": PROMPTS}))
    out = tmp_path / "acts.safetensors"
    code = main(
        [
            "extract",
            "--model",
            str(directory),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--layers",
            "0..2",
            "--positions",
            "all",
            "--chat-template",
            "off",
            "--batch-size",
            "2",
        ]
    )
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    result = json.loads(stdout)
    assert (
        result["layers"] == [0, 1] and result["prompts"] == 5 and result["chat_template"] == "off"
    )
    bars = [json.loads(line) for line in stderr.splitlines() if '"done"' in line]
    assert [b["done"] for b in bars] == [2, 4, 5]  # one event per batch: streamed, not gathered
    tokenizer = Tokenizer.from_directory(directory)
    encoded = [tokenizer.encode(p) for p in PROMPTS]
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        assert (
            meta["model"] == str(directory)
            and meta["precision"] == "f32"
            and meta["positions"] == "all"
        )
        assert json.loads(meta["layers"]) == [0, 1] and meta["chat_template"] == "off"
        assert f.get_tensor("lengths").tolist() == [len(ids) for ids in encoded]
        assert f.get_tensor("token_ids").tolist() == [t for ids in encoded for t in ids]
        for layer in (0, 1):
            want = torch.cat([hf_residual(reference, ids)[layer] for ids in encoded])
            assert torch.allclose(f.get_tensor(f"layers.{layer}"), want, rtol=1e-4, atol=1e-4)


def test_extract_refuses_before_loading_and_writes_nothing(llama, tmp_path, capsys):
    directory, _ = llama
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["one"]}))
    out = tmp_path / "acts.safetensors"
    code = main(
        [
            "extract",
            "--model",
            str(directory),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--layers",
            "7",
        ]
    )
    assert code == 2 and "layer 7 is outside the model's 0..2 range" in capsys.readouterr().err
    prompts.write_text(json.dumps({"prompts": []}))
    code = main(
        ["extract", "--model", str(directory), "--input", str(prompts), "--output", str(out)]
    )
    assert code == 2 and "prompt set contains no prompts" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_extract_train_and_steered_generate_through_ray_at_tp2(llama, tmp_path):
    """The CLI with --tp 2: ranks as Ray actors on an embedded local cluster, one process per
    command."""
    import subprocess
    import sys

    directory, _ = llama
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": PROMPTS}))
    pairs = tmp_path / "pairs.json"
    pairs.write_text(
        json.dumps(
            {
                "trait_name": "t",
                "pairs": [
                    {"positive": a, "negative": b} for a, b in zip(PROMPTS[:2], PROMPTS[2:4])
                ],
            }
        )
    )

    def ster(*argv):
        done = subprocess.run(
            [sys.executable, "-m", "ster_dist.cli", *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    for tp in (1, 2):
        ster(
            "extract",
            "--model",
            directory,
            "--input",
            prompts,
            "--output",
            tmp_path / f"a{tp}.safetensors",
            "--layers",
            "1",
            "--tp",
            tp,
        )
        ster(
            "steer",
            "train",
            "--model",
            directory,
            "--pairs",
            pairs,
            "--output",
            tmp_path / f"v{tp}.json",
            "--layers",
            "1",
            "--tp",
            tp,
        )
    one, two = (
        safe_open(str(tmp_path / f"a{tp}.safetensors"), "pt").get_tensor("layers.1")
        for tp in (1, 2)
    )
    assert torch.allclose(one, two, rtol=1e-5, atol=1e-5)
    v1, v2 = (json.loads((tmp_path / f"v{tp}.json").read_text()) for tp in (1, 2))
    assert torch.allclose(
        torch.tensor(v1["vectors"][0]["values"]),
        torch.tensor(v2["vectors"][0]["values"]),
        atol=1e-4,
    )
    texts = [
        ster(
            "generate",
            "--model",
            directory,
            "--prompt",
            "hello",
            "--max-new-tokens",
            6,
            "--vector",
            tmp_path / "v1.json",
            "--strength",
            4,
            "--tp",
            tp,
        )["text"]
        for tp in (1, 2)
    ]
    assert texts[0] == texts[1]


def test_extract_under_a_lora_adapter_equals_the_peft_model(llama, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    directory, reference = llama
    adapter = tmp_path / "adapter"
    peft_model = get_peft_model(
        reference,
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False
        ),
    )
    peft_model.save_pretrained(adapter)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": PROMPTS[:3]}))
    out = tmp_path / "acts.safetensors"
    code = main(
        [
            "extract",
            "--model",
            str(directory),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--layers",
            "1",
            "--chat-template",
            "off",
            "--adapter",
            str(adapter),
        ]
    )
    assert code == 0, capsys.readouterr().err
    tokenizer = Tokenizer.from_directory(directory)
    with torch.no_grad():
        want = torch.stack(
            [
                peft_model(
                    torch.tensor([tokenizer.encode(p)]), output_hidden_states=True
                ).hidden_states[2][0, -1]
                for p in PROMPTS[:3]
            ]
        )
    with safe_open(str(out), "pt") as f:
        got = f.get_tensor("layers.1")
        assert f.metadata()["adapter"] == str(adapter)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    peft_model.unload()  # leave the module-scoped reference as it was
