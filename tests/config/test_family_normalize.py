"""Family config normalisation (FamilySpec.normalize, families/normalize.py): every family's
normaliser returns a new dict and leaves the config it was given as it was (config.from_hf checks
the values a normaliser replaced against the config as written), and its switches reach ModelConfig
through the generic keys."""

from __future__ import annotations

import copy

import pytest

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.families.normalize import ConfigProblem
from ster_dist.families.registry import FORMAT_SPECS, SPECS

CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "intermediate_size": 128,
    "attn_config": {"kv_n_heads": 2},
    "use_bias": True,
    "bias": True,
    "qk_layernorm": True,
    "logits_scaling": 2.0,
    "new_decoder_architecture": True,
    "hybrid_override_pattern": "M*",
    "kv_lora_rank": 16,
    "linear_attn_config": {
        "kda_layers": [1],
        "num_heads": 4,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
}
NORMALISED = sorted({spec.name for spec in SPECS.values() if spec.normalize is not None})


@pytest.mark.parametrize("family", NORMALISED)
def test_normaliser_leaves_its_input_unchanged(family):
    raw = {"model_type": family, **copy.deepcopy(CONFIG)}
    before = copy.deepcopy(raw)
    try:
        out = SPECS[family].normalize(raw)
    # a normaliser may refuse what it cannot read (Granite 4.0 and Gemma 4
    except (Refusal, ConfigProblem):
        out = None  # without layer_types)
    assert raw == before and out is not raw


def test_every_format_spec_normalises_as_its_transformers_spec():
    """A map of another checkpoint format reads the same config: its conventions may differ, its
    config keys not."""
    for specs in FORMAT_SPECS.values():
        for name, spec in specs.items():
            assert spec.normalize is SPECS[name].normalize


@pytest.mark.parametrize("use_bias", [True, False])
def test_a_family_key_reaches_the_biases_through_the_generic_keys(use_bias):
    """StarCoder2's use_bias switches every projection; Llama's attention_bias beside it means
    nothing to it."""
    cfg = from_hf(
        {"model_type": "starcoder2", **CONFIG, "use_bias": use_bias, "attention_bias": not use_bias}
    )
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_up_bias) == (use_bias,) * 3
