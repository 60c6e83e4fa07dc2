"""Dense families' own config keys that the tiny parity checkpoints cannot reach (keys Transformers
writes itself or refuses), each against Transformers' config class where it has one; sections follow
ster_dist/families/."""

from __future__ import annotations

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.layers.activation import XIELU

transformers = pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING  # noqa: E402

_SMALL = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 6,
    "vocab_size": 256,
    "intermediate_size": 128,
    "head_dim": 16,
}


def _raw(family: str, **keys) -> dict:
    return {"model_type": family, **_SMALL, **keys}


# --------------------------------------------------------------------------------------------------
# granite.py: Granite SWA's layer kinds and bases, HyperCLOVA X's post norms
# --------------------------------------------------------------------------------------------------


def test_granite_swa_unstated_layer_types_are_the_config_class_ones():
    raw = _raw("granite_swa", sliding_window=8)
    ref = CONFIG_MAPPING["granite_swa"].from_dict(dict(raw))
    mc = from_hf(raw)
    assert [w is not None for w in mc.layer_window] == [
        t == "sliding_attention" for t in ref.layer_types
    ]
    assert mc.layer_window[1] == 8 and mc.tie_word_embeddings and mc.attn_sinks


def test_granite_swa_layer_rope_theta():
    kinds = [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ]
    mc = from_hf(
        _raw(
            "granite_swa",
            sliding_window=8,
            layer_types=kinds,
            rope_theta=10000.0,
            layer_rope_theta=[10000.0, 0, 300.0, 0, 300.0, 10000.0],
        )
    )
    assert [None if r is None else r.theta for r in mc.layer_rope] == [
        10000.0,
        None,
        300.0,
        None,
        300.0,
        10000.0,
    ]
    for bases in (
        [10000.0, 300.0, 400.0, 0, 300.0, 10000.0],
        [500.0, 300.0, 300.0, 0, 300.0, 10000.0],
    ):
        with pytest.raises(Refusal, match="layer_rope_theta"):
            from_hf(
                _raw(
                    "granite_swa",
                    sliding_window=8,
                    layer_types=kinds,
                    rope_theta=10000.0,
                    layer_rope_theta=bases,
                )
            )
    with pytest.raises(Refusal, match="layer_rope_theta lists 2"):
        from_hf(_raw("granite_swa", layer_rope_theta=[0, 0]))


@pytest.mark.parametrize("use_post_norm", [None, True, False])
def test_hyperclovax_post_norms_and_logit_multiplier(use_post_norm):
    raw = _raw("hyperclovax", logits_scaling=0.25)
    if use_post_norm is not None:
        raw["use_post_norm"] = use_post_norm
    mc = from_hf(raw)
    assert mc.post_attn_norm == mc.post_mlp_norm == (use_post_norm is not False)
    assert mc.logit_multiplier == 0.25 and mc.pre_attn_norm


# --------------------------------------------------------------------------------------------------
# exaone.py: EXAONE 3's own key names
# --------------------------------------------------------------------------------------------------


def test_exaone_own_keys():
    raw = {
        "model_type": "exaone",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_layers": 3,
        "vocab_size": 256,
        "intermediate_size": 128,
        "layer_norm_epsilon": 1e-6,
        "activation_function": "silu",
    }
    ref = CONFIG_MAPPING["exaone"].from_dict(dict(raw))
    mc = from_hf(raw)
    assert (
        (mc.num_layers, mc.norm_eps, mc.num_kv_heads)
        == (ref.num_hidden_layers, ref.rms_norm_eps, ref.num_key_value_heads)
        == (3, 1e-6, 8)
    )
    assert mc.layer_rope[0].theta == ref.rope_parameters["rope_theta"] == 500_000.0
    unstated = from_hf({k: v for k, v in raw.items() if k != "layer_norm_epsilon"})
    assert unstated.norm_eps == CONFIG_MAPPING["exaone"].from_dict({}).rms_norm_eps


# --------------------------------------------------------------------------------------------------
# llama.py: IQuest-Coder's keys Transformers' config class refuses
# --------------------------------------------------------------------------------------------------


def test_iquestcoder_clip_and_sliding_window():
    mc = from_hf(
        _raw(
            "iquestcoder",
            clip_qkv=8.0,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=4,
            mlp_bias=True,
        )
    )
    assert mc.clip_qkv == 8.0 and mc.mlp_up_bias and mc.mlp_down_bias
    assert mc.layer_window == (None,) * 4 + (16, 16)


# --------------------------------------------------------------------------------------------------
# nemotron.py: Jais 2's and Apertus's defaults, Apertus's xIELU
# --------------------------------------------------------------------------------------------------


def test_jais2_and_apertus_defaults_are_the_config_class_ones():
    jais = from_hf(_raw("jais2"))
    ref = CONFIG_MAPPING["jais2"].from_dict(_raw("jais2"))
    assert (jais.hidden_act, jais.qkv_bias, jais.o_bias, jais.mlp_up_bias, jais.norm_eps) == (
        ref.hidden_act,
        ref.attention_bias,
        ref.attention_bias,
        ref.mlp_bias,
        ref.layer_norm_eps,
    )
    apertus = from_hf(_raw("apertus"))
    ref = CONFIG_MAPPING["apertus"].from_dict(_raw("apertus"))
    rope = apertus.layer_rope[0]
    assert apertus.hidden_act == ref.hidden_act == "xielu"
    assert (rope.rope_type, rope.theta, rope.factor) == (
        "llama3",
        ref.rope_parameters["rope_theta"],
        ref.rope_parameters["factor"],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xielu_matches_transformers(dtype):
    theirs = transformers.activations.XIELUActivation(
        alpha_p_init=0.6, alpha_n_init=0.9, beta=0.4, dtype=dtype
    )
    ours = XIELU()
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        setattr(
            ours,
            name,
            torch.nn.Parameter(getattr(theirs, name).detach().clone(), requires_grad=False),
        )
    x = torch.linspace(-6, 6, 241, dtype=dtype)
    torch.testing.assert_close(ours(x), theirs(x), atol=0, rtol=0)
