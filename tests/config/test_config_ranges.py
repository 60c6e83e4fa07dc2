"""config.json sizes and numbers out of type or range are refused in one line naming the key (issue
19)."""

import time

import pytest

from ster_dist.config import from_hf
from ster_dist.errors import Refusal


def llama(**overrides) -> dict:
    raw = {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    raw.update(overrides)
    return raw


def refused(raw) -> str:
    with pytest.raises(Refusal) as info:
        from_hf(raw)
    message = str(info.value)
    assert "\n" not in message and message.startswith("invalid model config config.json:")
    return message


@pytest.mark.parametrize(
    "key, value, named",
    [
        (
            "num_hidden_layers",
            10**9,
            "num_hidden_layers is 1000000000; it must be an integer from 1 to 10000",
        ),
        ("num_hidden_layers", 1e9, "num_hidden_layers is 1000000000.0"),
        ("num_hidden_layers", 0, "num_hidden_layers is 0"),
        ("num_attention_heads", 0, "num_attention_heads is 0"),
        ("num_attention_heads", -4, "num_attention_heads is -4"),
        ("num_attention_heads", 4.0, "num_attention_heads is 4.0; it must be an integer"),
        ("num_key_value_heads", 0, "num_key_value_heads is 0"),
        (
            "num_key_value_heads",
            3,
            "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
        ),
        ("hidden_size", "256", "hidden_size is '256'"),
        ("hidden_size", 250, "hidden_size 250 is not a multiple of num_attention_heads 4"),
        ("hidden_size", 1 << 21, "hidden_size is 2097152"),
        ("intermediate_size", True, "intermediate_size is True"),
        ("vocab_size", 1 << 25, "vocab_size is 33554432"),
        ("max_position_embeddings", 0, "max_position_embeddings is 0"),
        ("rope_theta", 0, "rope_theta is 0; it must be a finite number above 0"),
        ("rope_theta", "1e4", "rope_theta is '1e4'"),
        ("rms_norm_eps", -1e-5, "rms_norm_eps is -1e-05"),
        ("rms_norm_eps", float("inf"), "rms_norm_eps is inf"),
        ("rms_norm_eps", 10**400, "rms_norm_eps is 1000000"),
        ("head_dim", 0, "head_dim is 0"),
        ("eos_token_id", "2", "eos_token_id is '2'"),
        ("rope_scaling", [2.0], "rope_scaling is [2.0]; it must be a JSON object"),
        ("rope_scaling", {"rope_type": "llama3", "factor": 0}, "rope_scaling.factor is 0"),
        ("rope_scaling", {"rope_type": "longrope"}, "rope_scaling.short_factor is None"),
        (
            "rope_scaling",
            {"rope_type": "dynamic", "alpha": 1e300},
            "rope scaling alpha 1e+300 with rope_theta 500000.0 and head_dim 64 gives no finite rotation base",
        ),
        ("layer_types", 4, "layer_types is 4; it must be a list of strings"),
        ("no_rope_layers", [1, 1], "no_rope_layers lists 2 layers for 4 hidden layers"),
        # bool("false") is True: a switch stated as a string would turn on what it names
        (
            "tie_word_embeddings",
            "false",
            "tie_word_embeddings is 'false'; it must be true or false",
        ),
        ("attention_bias", "False", "attention_bias is 'False'; it must be true or false"),
        ("mlp_bias", [False], "mlp_bias is [False]; it must be true or false"),
        ("norm_topk_prob", 2, "norm_topk_prob is 2; it must be true or false"),
    ],
)
def test_a_bad_size_or_number_is_refused_naming_the_key(key, value, named):
    message = refused(llama(**{key: value}))
    assert named in message and "correct it in config.json" in message


def test_a_billion_layers_is_refused_at_once():
    start = time.monotonic()
    refused(llama(num_hidden_layers=10**9))
    assert time.monotonic() - start < 1


def test_a_gpt_style_alias_is_checked_too():
    raw = llama(num_attention_heads=None, n_head=0)
    assert "n_head is 0" in refused(raw)


def test_dbrx_nested_config_must_be_an_object():
    raw = {
        "model_type": "dbrx",
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "vocab_size": 100,
        "max_seq_len": 128,
        "attn_config": [1],
        "ffn_config": {},
    }
    assert "attn_config is not a JSON object" in refused(raw)


def test_sane_values_still_read():
    mc = from_hf(llama(num_hidden_layers=10_000, rms_norm_eps=1e-6, head_dim=32))
    assert (mc.num_layers, mc.head_dim, mc.num_kv_heads) == (10_000, 32, 2)
    # switches: true, false, 0 or 1
    assert from_hf(llama(tie_word_embeddings=True)).tie_word_embeddings
    assert not from_hf(llama(tie_word_embeddings=0)).tie_word_embeddings


@pytest.mark.parametrize("model_type", [{"llama": 1}, ["llama"], 7])
def test_a_model_type_that_is_not_a_string_is_refused(model_type):
    with pytest.raises(Refusal, match="unsupported by this ster_dist build"):
        from_hf(llama(model_type=model_type))
    with pytest.raises(Refusal, match="unsupported by this ster_dist build"):
        from_hf({"model_type": "gemma3", "text_config": {"model_type": model_type}})


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("n_layers", 10**9, "n_layers is 1000000000"),
        ("sliding_window", [8, [1]], "must list window sizes"),
        ("moe", [1], "moe is not a JSON object"),
        ("yarn", "x", "yarn is not a JSON object"),
    ],
)
def test_params_json_sizes_are_checked_before_the_pattern_is_built(key, value, named):
    from ster_dist.config.params import from_params

    raw = {
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "hidden_dim": 128,
        "norm_eps": 1e-5,
        "vocab_size": 1000,
        "sliding_window": [8, None],
    }
    with pytest.raises(Refusal, match=named):
        from_params({**raw, key: value})
