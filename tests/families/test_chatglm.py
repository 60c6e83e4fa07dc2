"""ChatGLM (families/chatglm.py, remote code) against Transformers' GLM on the same weights, written
under ChatGLM's names (transformer.encoder.layers.{i}.self_attention.query_key_value,
mlp.dense_h_to_4h, ...) with its own config keys (num_layers, ffn_hidden_size, kv_channels,
multi_query_group_num, rope_ratio, ...). GLM-4-9B's original_rope turns adjacent pairs as GLM does;
without it ChatGLM turns halves, checked against the same GLM with each head's rotated query and key
rows reordered in the checkpoint (pairs (2j, 2j+1) to (j, j + r/2)), which leaves every attention
score unchanged. GLM-4's tiktoken tokenizer.model is checked in
tests/tokenizer/test_tokenizer_formats.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ster_dist.errors import Refusal
from ster_dist.families.registry import family_table
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import engine_tokens
from tests.remote_checks import check_cache_and_batches, check_tp2_equals_tp1, random_ids
from tests.tiny_tokenizer import build_tiny_tokenizer

HEADS, GROUPS, HEAD_DIM, HIDDEN, FFN, LAYERS, VOCAB = 4, 2, 16, 32, 48, 2, 384
VARIANTS = {
    "glm4": {"original_rope": True, "rope_ratio": 50, "add_qkv_bias": True},
    "halves": {"original_rope": False, "rope_ratio": 1, "add_qkv_bias": True},
    "biased": {"original_rope": True, "rope_ratio": 2, "add_bias_linear": True},
}


def _glm(variant: dict):
    import transformers

    torch.manual_seed(0)
    biased = variant.get("add_bias_linear", False)
    config = transformers.GlmConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        attention_bias=True,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0 * variant["rope_ratio"],
            "partial_rotary_factor": 0.5,
        },
    )
    model = transformers.GlmForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn(param.shape) * 0.2)
        # ChatGLM's add_bias_linear biases every projection; GLM's only q/k/v: add them by hand
        if biased:
            for layer in model.model.layers:
                for module in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                    module.bias = torch.nn.Parameter(torch.randn(module.out_features) * 0.2)
    return model


def _halves_order(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rotated share (its first half) reordered from adjacent pairs to halves."""
    r = HEAD_DIM // 2
    order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, HEAD_DIM)])
    return rows.reshape(heads, HEAD_DIM, *rows.shape[1:])[:, order].reshape(rows.shape)


def _chatglm_state(model, halves: bool) -> dict[str, torch.Tensor]:
    s = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {
        "transformer.embedding.word_embeddings.weight": s["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": s["model.norm.weight"],
        "transformer.output_layer.weight": s["lm_head.weight"],
    }
    for i in range(LAYERS):
        p, t = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (s[f"{p}self_attn.{n}_proj.{kind}"] for n in "qkv")
            if halves:
                q, k = _halves_order(q, HEADS), _halves_order(k, GROUPS)
            out[f"{t}self_attention.query_key_value.{kind}"] = torch.cat([q, k, v])
        out |= {
            f"{t}self_attention.dense.weight": s[f"{p}self_attn.o_proj.weight"],
            f"{t}mlp.dense_h_to_4h.weight": s[f"{p}mlp.gate_up_proj.weight"],
            f"{t}mlp.dense_4h_to_h.weight": s[f"{p}mlp.down_proj.weight"],
            f"{t}input_layernorm.weight": s[f"{p}input_layernorm.weight"],
            f"{t}post_attention_layernorm.weight": s[f"{p}post_attention_layernorm.weight"],
        }
        for name, ours in (
            ("self_attn.o_proj", "self_attention.dense"),
            ("mlp.gate_up_proj", "mlp.dense_h_to_4h"),
            ("mlp.down_proj", "mlp.dense_4h_to_h"),
        ):
            if f"{p}{name}.bias" in s:
                out[f"{t}{ours}.bias"] = s[f"{p}{name}.bias"]
    return out


def _config(variant: dict) -> dict:
    return {
        "model_type": "chatglm",
        "architectures": ["ChatGLMModel"],
        "num_layers": LAYERS,
        "padded_vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "ffn_hidden_size": FFN,
        "kv_channels": HEAD_DIM,
        "num_attention_heads": HEADS,
        "multi_query_attention": True,
        "multi_query_group_num": GROUPS,
        "seq_length": 128,
        "layernorm_epsilon": 1e-5,
        "rmsnorm": True,
        "pad_token_id": 0,
        "eos_token_id": 2,
        **variant,
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    for name, variant in VARIANTS.items():
        directory = tmp_path_factory.mktemp(name)
        model = _glm(variant)
        save_file(
            _chatglm_state(model, halves=not variant["original_rope"]),
            str(directory / "model.safetensors"),
        )
        (directory / "config.json").write_text(json.dumps(_config(variant)))
        build_tiny_tokenizer(directory, vocab_size=VOCAB)
        out[name] = (directory, model, load_model(resolve(str(directory)), "f32"))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_tokens_equal_transformers_glm(built, variant):
    _, reference, loaded = built[variant]
    assert loaded.cfg.family == "chatglm" and loaded.cfg.num_kv_heads == GROUPS
    ids = random_ids(2, 30)
    with torch.no_grad():
        result = compare(loaded.model(ids), reference(ids).logits)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, (variant, result)
    prompt = random_ids(1, 7, seed=1)[0]
    want = reference.generate(
        prompt[None], max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0
    )[0, 7:].tolist()
    got = engine_tokens(loaded, [prompt.tolist()], 10, loaded.cfg.eos_token_ids)[0]
    assert got == want[: len(got)] and len(got) == len(want)


@pytest.mark.parametrize("variant", ["glm4", "halves"])
def test_decoding_from_cache_equals_reading_whole_and_batches_equal_one_by_one(built, variant):
    check_cache_and_batches(built[variant][2], variant)


def test_tp2_equals_tp1(built):
    check_tp2_equals_tp1(
        {variant: (directory, loaded) for variant, (directory, _, loaded) in built.items()}
    )


def test_ster_families_lists_chatglm_as_parity_checked_against_this_file():
    rows = {row["family"]: row for row in family_table()}
    assert (
        rows["chatglm"]["status"] == "parity-checked"
        and rows["chatglm"]["reference"] == "tests/families/test_chatglm.py"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"apply_residual_connection_post_layernorm": True},
            "apply_residual_connection_post_layernorm is set",
        ),
        ({"post_layer_norm": False}, "post_layer_norm is false"),
        ({"rope_ratio": 0}, "rope_ratio is 0"),
    ],
)
def test_what_chatglm_cannot_state_is_refused_before_any_weight(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**_config(VARIANTS["glm4"]), **change}))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    build_tiny_tokenizer(tmp_path, vocab_size=VOCAB)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(tmp_path)))
    assert message in str(refused.value) and "\n" not in str(refused.value)
