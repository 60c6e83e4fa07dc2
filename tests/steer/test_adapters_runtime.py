"""Runtime adapters: logits with an adapter attached unmerged equal PEFT's at TP=1 and at TP=2 on
real gloo ranks (plain, Conv1D and fused layouts, rsLoRA, rank / alpha patterns); a Ster adapter
attached equals its merged checkpoint; `ster generate --adapter` generates what the merged
checkpoint generates; detaching restores the base; refusals come before any rank is touched."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ster_dist.adapters.attach import attach, attach_for_cli
from ster_dist.adapters.format import open_adapter
from ster_dist.adapters.merge import merge
from ster_dist.adapters.targets import sites_for
from ster_dist.cli import main
from ster_dist.config.load import model_config
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.steer.test_merge import IDS, PEFT_CASES, max_relative, peft_adapter, ster_adapter
from tests.tiny_models import make_tiny


@pytest.fixture(scope="module")
def group():
    with SpawnGroup(2) as g:
        yield g


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """family -> (directory with base/ and adapter/, PEFT's logits with the adapter unmerged)."""
    out = {}
    for family, (targets, lora) in PEFT_CASES.items():
        root = tmp_path_factory.mktemp(family)
        make_tiny(family, root / "base")
        peft_model = peft_adapter(root / "base", root / "adapter", targets, seed=3, **lora)
        with torch.no_grad():
            out[family] = (root, peft_model(IDS).logits)
    return out


def _session(directory, group):
    checkpoint = resolve(str(directory))
    group.call("load", checkpoint, "f32", "cpu")
    return SimpleNamespace(
        checkpoint=checkpoint, cfg=model_config(checkpoint), group=group, provenance={}
    )


@pytest.mark.parametrize("family", sorted(PEFT_CASES))
def test_attached_adapter_logits_equal_peft_at_tp1_and_tp2(group, cases, family):
    root, expected = cases[family]
    loaded = load_model(resolve(str(root / "base")))
    sites = sites_for(open_adapter(root / "adapter"), loaded.cfg, str(root / "base"))
    with torch.no_grad():
        base = loaded.model(IDS)
        detach = attach(loaded.model, sites)
        tp1 = loaded.model(IDS)
        detach()
        assert torch.equal(loaded.model(IDS), base)
    assert max_relative(tp1, expected) < 1e-5
    session = _session(root / "base", group)
    detach = attach_for_cli(session, SimpleNamespace(adapter=str(root / "adapter")))
    assert session.provenance["adapter"]["format"] == "peft"
    tp2 = group.call("logits", IDS)[0]
    detach()
    assert max_relative(tp2, expected) < 1e-5
    assert (
        max_relative(group.call("logits", IDS)[0], base) < 1e-5
        and "adapter" not in session.provenance
    )


def test_ster_adapter_attached_at_tp2_equals_its_merged_checkpoint(group, tmp_path):
    make_tiny("phi3", tmp_path / "base")
    ster_adapter(
        tmp_path / "calm.safetensors",
        tmp_path / "base",
        ["query", "key", "value", "output", "gate", "up", "down"],
        [0, 1, 2],
    )
    merge(str(tmp_path / "base"), str(tmp_path / "calm.safetensors"), tmp_path / "merged")
    with torch.no_grad():
        expected = load_model(resolve(str(tmp_path / "merged"))).model(IDS)
    session = _session(tmp_path / "base", group)
    detach = attach_for_cli(session, SimpleNamespace(adapter=str(tmp_path / "calm.safetensors")))
    try:
        assert max_relative(group.call("logits", IDS)[0], expected) < 1e-5
    finally:
        detach()


def test_generate_with_an_adapter_generates_what_the_merged_checkpoint_does(
    cases, tmp_path, capsys
):
    root, _ = cases["llama"]
    merge(str(root / "base"), str(root / "adapter"), tmp_path / "merged")
    common = ["--prompt", "the cat sat on", "--max-new-tokens", "12", "--chat-template", "off"]
    assert (
        main(
            ["generate", "--model", str(root / "base"), "--adapter", str(root / "adapter"), *common]
        )
        == 0
    )
    attached = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", str(tmp_path / "merged"), *common]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert (
        attached["text"] == merged["text"]
        and attached["completion_tokens"] == merged["completion_tokens"] == 12
    )


def test_refusals_at_attach(cases, tmp_path, capsys):
    root, _ = cases["llama"]
    base = str(root / "base")
    (tmp_path / "V.json").write_text(
        json.dumps(
            {
                "schema_version": 1,
                "trait_name": "calm",
                "layers": [{"layer": 1, "vector": [0.0] * 48}],
            }
        )
    )
    ster_adapter(
        tmp_path / "other.safetensors", root / "base", ["query"], [0], model="someone/else"
    )
    gpt2 = cases["gpt2"][0]
    ster_adapter(tmp_path / "g.safetensors", gpt2 / "base", ["up"], [0])
    sidecar = json.loads((tmp_path / "g.json").read_text())
    (tmp_path / "g.json").write_text(json.dumps({**sidecar, "targets": ["gate"]}))
    (tmp_path / "g.safetensors").rename(tmp_path / "g-up.safetensors")
    from safetensors.torch import load_file, save_file

    up = load_file(tmp_path / "g-up.safetensors")
    save_file(
        {"layers.0.gate.a": up["layers.0.up.a"], "layers.0.gate.b": up["layers.0.up.b"]},
        str(tmp_path / "g.safetensors"),
    )
    for model, adapter, message in (
        (base, tmp_path / "V.json", "V.json is a steering artifact, not a LoRA adapter sidecar"),
        (base, tmp_path / "missing", "failed to read adapter"),
        (base, tmp_path / "other.safetensors", 'adapter was trained for model "someone/else"'),
        (str(gpt2 / "base"), tmp_path / "g.safetensors", "feed-forward is plain (no gate)"),
    ):
        code = main(
            [
                "generate",
                "--model",
                model,
                "--adapter",
                str(adapter),
                "--prompt",
                "hi",
                "--max-new-tokens",
                "2",
            ]
        )
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err
    loaded = load_model(resolve(str(gpt2 / "base")))
    with pytest.raises(Refusal, match="no gate"):
        sites_for(open_adapter(tmp_path / "g.safetensors"), loaded.cfg, str(gpt2 / "base"))


def test_an_attention_adapter_on_an_experts_family_equals_peft_at_tp2(group, tmp_path):
    from ster_dist.families.registry import spec_for
    from tests.tiny_models import TINY

    if spec_for("mixtral") is None or "mixtral" not in TINY:
        pytest.skip("no mixture-of-experts family in this build yet")
    make_tiny("mixtral", tmp_path / "base")
    peft_model = peft_adapter(
        tmp_path / "base",
        tmp_path / "adapter",
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        r=4,
        lora_alpha=8,
        use_rslora=True,
    )
    with torch.no_grad():
        expected = peft_model(IDS).logits
    session = _session(tmp_path / "base", group)
    detach = attach_for_cli(session, SimpleNamespace(adapter=str(tmp_path / "adapter")))
    try:
        assert max_relative(group.call("logits", IDS)[0], expected) < 1e-5
    finally:
        detach()
