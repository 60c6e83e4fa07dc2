"""`ster tune inspect` (and `ster request tune/inspect`): a PEFT adapter written here with
safetensors, read back as its config and tensors declare it; a steering artifact refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ster_dist.cli import main

MODULE = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"


def test_an_adapter_is_summarised_as_it_declares_itself(tmp_path, capsys):
    config = {
        "peft_type": "LORA",
        "r": 2,
        "lora_alpha": 8,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": "toy",
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file(
        {
            MODULE.format(layer, side): torch.zeros(shape)
            for layer in (0, 1)
            for side, shape in (("A", (2, 64)), ("B", (64, 2)))
        },
        tmp_path / "adapter_model.safetensors",
    )
    capsys.readouterr()
    assert main(["tune", "inspect", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["format"], out["model"], out["rank"], out["alpha"]) == ("peft", "toy", 2, 8.0)
    assert [(f["key"], f["a_shape"], f["b_shape"], f["scale"]) for f in out["factors"]] == [
        (f"model.layers.{layer}.self_attn.q_proj", [2, 64], [64, 2], 4.0) for layer in (0, 1)
    ]


def test_a_steering_artifact_is_not_an_adapter(capsys):
    artifact = Path(__file__).parents[1] / "data" / "ster_docs" / "steering-artifact.json"
    capsys.readouterr()
    assert main(["tune", "inspect", str(artifact)]) == 2
    assert "is a steering artifact" in capsys.readouterr().err
