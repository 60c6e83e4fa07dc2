"""PLaMo 3 (families/plamo.py) against Transformers' Gemma 3 on the same weights: Gemma 3's block is
PLaMo 3's (sandwich norms stored as offsets, per-head query/key norms, every pattern-th layer
attending fully at its own base, the others through a window at a local base), except that PLaMo's
post-sublayer norms count from 1/5 and 5^-1.5 where Gemma's count from one: the map below moves that
difference into the weights, and writes the checkpoint under PLaMo's names (model.layers.layers.{i},
mixer.qkv_proj, mlp.gate_up_proj). Under scale_embedding the embedding is multiplied by sqrt(hidden)
as Gemma's always is; without it the reference is handed the unscaled rows. The tokenizer is PLaMo's
tokenizer.jsonl (tests/tokenizer/test_tokenizer_plamo.py). Transformers has no PLaMo class, and
ster_dist never runs the checkpoint's own code.
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
from ster_dist.tokenizer import Tokenizer
from tests.cli_run import cli_generate
from tests.engine_checks import engine_tokens
from tests.remote_checks import (
    check_cache_and_batches,
    check_tp2_equals_tp1,
    greedy_by_rereading,
    random_ids,
)
from tests.tokenizer.test_tokenizer_plamo import make_rows, write_plamo

SIZES = dict(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
WINDOW, PATTERN, LOCAL_THETA, THETA = 6, 2, 10_000.0, 150_000.0
VARIANTS = {
    "plamo3": {"scale_embedding": False},
    "plamo3-yarn": {
        "scale_embedding": True,
        "rope_scaling_factor": 4.0,
        "initial_context_length": 16,
    },
}
POST_OFFSETS = {"post_mixer_norm": 1 / 5, "post_mlp_norm": 5**-1.5}


def _config(extra: dict) -> dict:
    return {
        "model_type": "plamo3",
        "architectures": ["Plamo3ForCausalLM"],
        **SIZES,
        "window_size": WINDOW,
        "sliding_window_pattern": PATTERN,
        "rope_theta": THETA,
        "rope_local_theta": LOCAL_THETA,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        **extra,
    }


def _plamo_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, heads, kv, d = (
        SIZES[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    )

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    state = {
        "model.embed_tokens.weight": rand(SIZES["vocab_size"], h, scale=0.5),
        "model.norm.weight": rand(h),
    }
    for i in range(SIZES["num_hidden_layers"]):
        p = f"model.layers.layers.{i}."
        state |= {
            p + "mixer.qkv_proj.weight": rand((heads + 2 * kv) * d, h),
            p + "mixer.o_proj.weight": rand(h, heads * d),
            p + "mixer.q_norm.weight": rand(d),
            p + "mixer.k_norm.weight": rand(d),
            p + "mlp.gate_up_proj.weight": rand(2 * inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
        state |= {
            p + name: rand(h)
            for name in (
                "pre_mixer_norm.weight",
                "post_mixer_norm.weight",
                "pre_mlp_norm.weight",
                "post_mlp_norm.weight",
            )
        }
    return state


def _gemma3(state: dict, extra: dict):
    """Transformers' Gemma 3 holding the same weights under its names, the post norms' offsets moved
    in."""
    import transformers

    heads, kv, d, inter = (
        SIZES[k]
        for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    )
    full = {"rope_type": "default", "rope_theta": THETA}
    if extra.get("rope_scaling_factor", 1) != 1:
        full = {
            "rope_type": "yarn",
            "rope_theta": THETA,
            "factor": extra["rope_scaling_factor"],
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": extra["initial_context_length"],
            "truncate": False,
        }
    config = transformers.Gemma3TextConfig(
        **{k: v for k, v in SIZES.items()},
        hidden_activation="silu",
        query_pre_attn_scalar=SIZES["head_dim"],
        sliding_window=WINDOW,
        layer_types=[
            "full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention"
            for i in range(SIZES["num_hidden_layers"])
        ],
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA},
        },
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    model = transformers.Gemma3ForCausalLM(config).eval()
    ours = {
        "model.embed_tokens.weight": state["model.embed_tokens.weight"],
        "model.norm.weight": state["model.norm.weight"],
    }
    for i in range(SIZES["num_hidden_layers"]):
        p, t = f"model.layers.layers.{i}.", f"model.layers.{i}."
        q, k, v = state[p + "mixer.qkv_proj.weight"].split([heads * d, kv * d, kv * d])
        gate, up = state[p + "mlp.gate_up_proj.weight"].split([inter, inter])
        ours |= {
            t + "self_attn.q_proj.weight": q,
            t + "self_attn.k_proj.weight": k,
            t + "self_attn.v_proj.weight": v,
            t + "self_attn.o_proj.weight": state[p + "mixer.o_proj.weight"],
            t + "self_attn.q_norm.weight": state[p + "mixer.q_norm.weight"],
            t + "self_attn.k_norm.weight": state[p + "mixer.k_norm.weight"],
            t + "mlp.gate_proj.weight": gate,
            t + "mlp.up_proj.weight": up,
            t + "mlp.down_proj.weight": state[p + "mlp.down_proj.weight"],
            t + "input_layernorm.weight": state[p + "pre_mixer_norm.weight"],
            t + "pre_feedforward_layernorm.weight": state[p + "pre_mlp_norm.weight"],
            # Gemma scales by 1 + w, PLaMo by offset + w
            t + "post_attention_layernorm.weight": state[p + "post_mixer_norm.weight"]
            + POST_OFFSETS["post_mixer_norm"]
            - 1,
            t + "post_feedforward_layernorm.weight": state[p + "post_mlp_norm.weight"]
            + POST_OFFSETS["post_mlp_norm"]
            - 1,
        }
    missing, unexpected = model.load_state_dict(ours, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    embed = model.model.embed_tokens

    def forward(ids):
        with torch.no_grad():
            if extra.get("scale_embedding"):
                return model(ids).logits
            return model(inputs_embeds=torch.nn.functional.embedding(ids, embed.weight)).logits

    return forward


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    for n, (variant, extra) in enumerate(VARIANTS.items()):
        directory = write_plamo(tmp_path_factory.mktemp(variant), make_rows())
        (directory / "config.json").write_text(json.dumps(_config(extra)))
        state = _plamo_state(seed=n)
        save_file(state, str(directory / "model.safetensors"))
        out[variant] = (
            directory,
            _gemma3(state, extra),
            load_model(resolve(str(directory)), "f32"),
        )
    return out


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return random_ids(batch, length, seed, low=4, high=500)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_tokens_match_the_reference(built, variant):
    _, reference, loaded = built[variant]
    assert loaded.cfg.family == "plamo3"
    ids = _ids(2, 40)  # past the window and the YaRN variant's initial_context_length
    with torch.no_grad():
        result = compare(loaded.model(ids), reference(ids))
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, (variant, result)
    prompt = _ids(1, 7, seed=1)[0].tolist()
    eos = loaded.cfg.eos_token_ids
    assert engine_tokens(loaded, [prompt], 12, eos)[0] == greedy_by_rereading(
        reference, prompt, 12, eos[0]
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_from_cache_equals_reading_whole_and_batches_equal_one_by_one(built, variant):
    check_cache_and_batches(built[variant][2], variant)


def test_tp2_equals_tp1(built):
    check_tp2_equals_tp1(
        {variant: (directory, loaded) for variant, (directory, _, loaded) in built.items()}
    )


def test_the_token_engine_reads_its_jsonl_tokenizer_and_answers_as_the_reference(built):
    directory, reference, loaded = built["plamo3-yarn"]
    prompt = "hello world, this is a test!"
    tokenizer = Tokenizer.from_directory(directory)
    ids = tokenizer.encode(prompt)
    assert ids[0] == tokenizer.backend.token_to_id("<|plamo:bos|>")  # add_bos_token
    want = greedy_by_rereading(reference, ids, 8, loaded.cfg.eos_token_ids[0])
    got = cli_generate(
        f"--model={directory}", f"--prompt={prompt}", "--chat-template=off", "--max-new-tokens=8"
    )
    assert got["prompt_tokens"] == len(ids)
    assert got["text"] == tokenizer.decode([t for t in want if t not in loaded.cfg.eos_token_ids])


def test_layers_slide_by_pattern_and_the_post_norms_keep_their_offsets(built):
    cfg = built["plamo3"][2].cfg
    assert [w is None for w in cfg.layer_window] == [
        (i + 1) % PATTERN == 0 for i in range(SIZES["num_hidden_layers"])
    ]
    assert {w for w in cfg.layer_window if w is not None} == {WINDOW}
    block = built["plamo3"][2].model.layers[0]
    assert (block.attn_norm.offset, block.post_attn_norm.offset, block.post_mlp_norm.offset) == (
        1.0,
        POST_OFFSETS["post_mixer_norm"],
        POST_OFFSETS["post_mlp_norm"],
    )


def test_ster_families_lists_plamo3_as_parity_checked_against_this_file():
    rows = {row["family"]: row for row in family_table()}
    assert (
        rows["plamo3"]["status"] == "parity-checked"
        and rows["plamo3"]["reference"] == "tests/families/test_plamo3.py"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"linear_type": "fp8"}, "linear_type is 'fp8'"),
        ({"rope_scaling_factor": 2.0}, "rope_scaling_factor is 2.0 without initial_context_length"),
        ({"sliding_window_pattern": 0}, "sliding_window_pattern is 0"),
    ],
)
def test_what_plamo3_cannot_state_is_refused_before_any_weight(built, tmp_path, change, message):
    source = built["plamo3"][0]
    config = {**json.loads((source / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    write_plamo(tmp_path, make_rows())
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(tmp_path)))
    assert message in str(refused.value) and "\n" not in str(refused.value)
