"""Dense families Transformers has no model class for (families/internlm.py, and minicpm, orion and
solar in families/llama.py), each against a plain-torch reference written here from the seed's
description: a tiny random checkpoint in the family's real tensor names and config keys, then
logits, greedy generation, decoding from the cache, batched generation, TP=2, the token engine and a
PEFT adapter on InternLM2's fused wqkv.

The reference reads canonical weights (the `_canonical` dict below, never ster_dist's names); each
family's writer stores them under the family's own names and layout (InternLM2's wqkv grouped by
key-value head), so a wrong name map, fused layout, bias rule, norm kind or scale shows as a logits
mismatch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ster_dist.errors import Refusal
from ster_dist.families.registry import SPECS, family_table
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.spawn import SpawnGroup
from tests.cli_run import cli_generate
from tests.engine_checks import engine_tokens
from tests.tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer

HIDDEN, HEADS, KV_HEADS, INNER, LAYERS, THETA = 48, 4, 2, 80, 4, 10000.0
HEAD_DIM = HIDDEN // HEADS
SIZES = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=HIDDEN,
    intermediate_size=INNER,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=256,
    rope_theta=THETA,
    hidden_act="silu",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True)
class Reference:
    """What the seed says the family computes, in the reference's own terms."""

    qkv_bias: bool = False
    o_bias: bool = False
    norm: str = "rms"  # "rms" | "layer" (biased LayerNorm)
    eps: float = 1e-6
    tied: bool = False
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    # Solar's block skips: kept before the layers of the first two lists, mixed in before those of
    # the last two
    bskcn: tuple[tuple[int, ...], ...] = ((), (), (), ())
    bskcn_weight: float = 0.0


@dataclass(frozen=True)
class Family:
    config: dict  # config.json beyond SIZES (the family's own keys)
    reference: Reference
    # canonical -> checkpoint names where they are not Llama's
    names: dict = field(default_factory=dict)


def _llama_names(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(canonical)


def _internlm2_names(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """InternLM2's names; wqkv rows per key-value head: that head's queries, then its key, then its
    value."""
    top = {
        "model.embed_tokens.weight": "model.tok_embeddings.weight",
        "lm_head.weight": "output.weight",
        "model.norm.weight": "model.norm.weight",
    }
    renames = {
        "self_attn.o_proj": "attention.wo",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.up_proj": "feed_forward.w3",
        "mlp.down_proj": "feed_forward.w2",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    out = {top[k]: v for k, v in canonical.items() if k in top}
    per_kv = HEADS // KV_HEADS
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if f"{p}self_attn.q_proj.{kind}" not in canonical:
                continue
            q, k, v = (canonical[f"{p}self_attn.{n}_proj.{kind}"] for n in "qkv")
            q = q.reshape(KV_HEADS, per_kv * HEAD_DIM, *q.shape[1:])
            k, v = (t.reshape(KV_HEADS, HEAD_DIM, *t.shape[1:]) for t in (k, v))
            out[f"{p}attention.wqkv.{kind}"] = torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])
        for name, tensor in canonical.items():
            if name.startswith(p):
                module, kind = name.removeprefix(p).rsplit(".", 1)
                if module in renames:
                    out[f"{p}{renames[module]}.{kind}"] = tensor
    return out


FAMILIES = {
    # bias left unstated: InternLM2's class biases wqkv and wo by default
    "internlm2": (
        Family(
            {"architectures": ["InternLM2ForCausalLM"], "rms_norm_eps": 1e-6},
            Reference(qkv_bias=True, o_bias=True),
        ),
        _internlm2_names,
    ),
    # query/key/value biased, the output not: the two keys apart
    "internlm3": (
        Family(
            {
                "architectures": ["InternLM3ForCausalLM"],
                "qkv_bias": True,
                "bias": False,
                "rms_norm_eps": 1e-5,
                "head_dim": HEAD_DIM,
            },
            Reference(qkv_bias=True, eps=1e-5),
        ),
        _llama_names,
    ),
    "minicpm": (
        Family(
            {
                "architectures": ["MiniCPMForCausalLM"],
                "scale_emb": 12,
                "scale_depth": 1.4,
                "dim_model_base": 16,
                "rms_norm_eps": 1e-5,
            },
            Reference(
                eps=1e-5,
                tied=True,
                embed_scale=12.0,
                residual_scale=1.4 / math.sqrt(LAYERS),
                logit_scale=16 / HIDDEN,
            ),
        ),
        _llama_names,
    ),
    # slot 1 keeps before 0 and 2 and mixes before 1 and 3; slot 2 keeps before 1 (ahead of slot 1's
    # mix there)
    # and mixes before 3, after slot 1
    "solar": (
        Family(
            {
                "architectures": ["SolarForCausalLM"],
                "rms_norm_eps": 1e-5,
                "bskcn_1": [0, 2],
                "bskcn_2": [1],
                "bskcn_3": [1, 3],
                "bskcn_4": [3],
                "bskcn_tv": [0.9, 0.7],
            },
            Reference(eps=1e-5, bskcn=((0, 2), (1,), (1, 3), (3,)), bskcn_weight=0.7),
        ),
        _llama_names,
    ),
    "orion": (
        Family(
            {
                "architectures": ["OrionForCausalLM"],
                "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False,
            },
            Reference(norm="layer", eps=1e-5),
        ),
        _llama_names,
    ),
}
NAMES = sorted(FAMILIES)


def _canonical(ref: Reference, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in Llama's names; norms away from one (and biased where LayerNorm) so a
    misread norm shows."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=gen) * scale

    def norm(prefix):
        out = {f"{prefix}.weight": 1 + rand(HIDDEN, scale=0.2)}
        if ref.norm == "layer":
            out[f"{prefix}.bias"] = rand(HIDDEN, scale=0.1)
        return out

    w = {
        "model.embed_tokens.weight": rand(TINY_VOCAB_SIZE, HIDDEN, scale=0.5),
        **norm("model.norm"),
    }
    if not ref.tied:
        w["lm_head.weight"] = rand(TINY_VOCAB_SIZE, HIDDEN, scale=0.3)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update(norm(f"{p}input_layernorm"), **norm(f"{p}post_attention_layernorm"))
        for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            w[f"{p}self_attn.{name}_proj.weight"] = rand(rows * HEAD_DIM, HIDDEN, scale=0.2)
            if ref.qkv_bias:
                w[f"{p}self_attn.{name}_proj.bias"] = rand(rows * HEAD_DIM, scale=0.2)
        w[f"{p}self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM, scale=0.2)
        if ref.o_bias:
            w[f"{p}self_attn.o_proj.bias"] = rand(HIDDEN, scale=0.2)
        w[f"{p}mlp.gate_proj.weight"] = rand(INNER, HIDDEN, scale=0.2)
        w[f"{p}mlp.up_proj.weight"] = rand(INNER, HIDDEN, scale=0.2)
        w[f"{p}mlp.down_proj.weight"] = rand(HIDDEN, INNER, scale=0.2)
    return w


# -- the reference forward (plain torch, from the seed's text)
# ---------------------------------------------------


def _norm(x, w, prefix, ref):
    if ref.norm == "layer":
        return F.layer_norm(x, (HIDDEN,), w[f"{prefix}.weight"], w[f"{prefix}.bias"], ref.eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ref.eps) * w[f"{prefix}.weight"]


def _linear(x, w, prefix):
    return F.linear(x, w[f"{prefix}.weight"], w.get(f"{prefix}.bias"))


def _rotate(x, positions):
    """Llama's rotation by halves: [batch, heads, seq, head_dim] at positions [seq]."""
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = positions[:, None].double() * inv[None]
    cos, sin = (torch.cat([t, t], -1).float() for t in (angles.cos(), angles.sin()))
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_logits(w: dict, ref: Reference, ids: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] of unpadded ids, every position from zero."""
    batch, seq = ids.shape
    positions = torch.arange(seq)
    h = w["model.embed_tokens.weight"][ids] * ref.embed_scale
    causal = torch.full((seq, seq), float("-inf")).triu(1)
    kept_1 = kept_2 = None
    keep_1, keep_2, mix_1, mix_2 = ref.bskcn
    for i in range(LAYERS):
        if i in keep_1:
            kept_1 = h
        if i in keep_2:
            kept_2 = h
        if i in mix_1:
            h = ref.bskcn_weight * kept_1 + (1 - ref.bskcn_weight) * h
        if i in mix_2:
            h = ref.bskcn_weight * kept_2 + (1 - ref.bskcn_weight) * h
        p = f"model.layers.{i}."
        x = _norm(h, w, f"{p}input_layernorm", ref)
        q, k, v = (
            _linear(x, w, f"{p}self_attn.{n}_proj").view(batch, seq, -1, HEAD_DIM).transpose(1, 2)
            for n in "qkv"
        )
        q, k = _rotate(q, positions), _rotate(k, positions)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM) + causal
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, HIDDEN)
        h = h + _linear(a, w, f"{p}self_attn.o_proj") * ref.residual_scale
        x = _norm(h, w, f"{p}post_attention_layernorm", ref)
        m = _linear(
            F.silu(_linear(x, w, f"{p}mlp.gate_proj")) * _linear(x, w, f"{p}mlp.up_proj"),
            w,
            f"{p}mlp.down_proj",
        )
        h = h + m * ref.residual_scale
    head = w["model.embed_tokens.weight"] if ref.tied else w["lm_head.weight"]
    return _norm(h, w, "model.norm", ref) @ head.T * ref.logit_scale


def reference_greedy(w: dict, ref: Reference, prompt: list[int], new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(reference_logits(w, ref, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


# -- checkpoints
# ---------------------------------------------------------------------------------------------------


def write_checkpoint(name: str, directory: Path, seed: int = 0, **config) -> dict:
    family, writer = FAMILIES[name]
    weights = _canonical(family.reference, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps({"model_type": name, **SIZES, **family.config, **config})
    )
    save_file(
        {k: v.contiguous() for k, v in writer(weights).items()},
        str(directory / "model.safetensors"),
    )
    build_tiny_tokenizer(directory)
    return weights


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote_dense")
    out = {}
    for seed, name in enumerate(NAMES):
        directory = root / name
        weights = write_checkpoint(name, directory, seed=seed)
        out[name] = (directory, weights, load_model(resolve(str(directory)), "f32"))
    return out


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_reference(checkpoints, name):
    _, weights, loaded = checkpoints[name]
    ids = _ids(2, 40)
    with torch.no_grad():
        result = compare(
            loaded.model(ids), reference_logits(weights, FAMILIES[name][0].reference, ids)
        )
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, (name, result)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_the_reference(checkpoints, name):
    _, weights, loaded = checkpoints[name]
    prompt = _ids(1, 7, seed=1)[0].tolist()
    with torch.no_grad():
        want = reference_greedy(weights, FAMILIES[name][0].reference, prompt, 10)
    assert engine_tokens(loaded, [prompt], 10)[0] == want


@pytest.mark.parametrize("name", NAMES)
def test_decoding_from_cache_equals_reading_whole(checkpoints, name):
    model = checkpoints[name][2].model
    ids = _ids(2, 20, seed=2)
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache(2, 20)
        parts = [model(ids[:, :12], cache=cache)] + [
            model(ids[:, t : t + 1], cache=cache) for t in range(12, 20)
        ]
    assert compare(torch.cat(parts, dim=1), whole)["max_relative_error"] < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_batched_generation_equals_one_by_one(checkpoints, name):
    loaded = checkpoints[name][2]
    prompts = [_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 9, 6)]
    assert engine_tokens(loaded, prompts, 8) == [engine_tokens(loaded, [p], 8)[0] for p in prompts]


@pytest.fixture(scope="module")
def group():
    with SpawnGroup(2) as g:
        yield g


# InternLM2's grouped wqkv (each rank reads its key-value groups' rows) and Solar's skips run by
# default; the rest
# add only switches TP does not touch and run under -m slow
def _by_default(*names):
    return [name if name in names else pytest.param(name, marks=pytest.mark.slow) for name in NAMES]


@pytest.mark.parametrize("name", _by_default("internlm2", "solar"))
def test_tp2_equals_tp1(checkpoints, group, name):
    directory, _, single = checkpoints[name]
    checkpoint = resolve(str(directory))
    group.call("load", checkpoint, "f32", "cpu")
    ids = _ids(2, 24, seed=3)
    with torch.no_grad():
        tp1 = single.model(ids)
    assert compare(group.call("logits", ids)[0], tp1)["max_relative_error"] < 1e-5
    prompts = [ids[0, :7].tolist(), ids[1, :4].tolist()]
    assert engine_tokens(group, prompts, 8, (), checkpoint) == engine_tokens(single, prompts, 8)


@pytest.mark.parametrize("name", _by_default("internlm2", "solar"))
def test_the_token_engine_answers_as_the_reference(checkpoints, name):
    """`ster generate` (the paged token engine, tokenizer and all) against the reference's greedy
    tokens."""
    directory, weights, _ = checkpoints[name]
    prompt = "The quick brown fox jumps over the lazy dog."
    tokenizer = Tokenizer.from_directory(directory)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        want = reference_greedy(weights, FAMILIES[name][0].reference, ids, 6)
    if 2 in want:  # the engine stops at the end-of-turn id
        want = want[: want.index(2)]
    got = cli_generate(
        f"--model={directory}", f"--prompt={prompt}", "--chat-template=off", "--max-new-tokens=6"
    )
    assert got["prompt_tokens"] == len(ids)
    assert got["text"] == tokenizer.decode(want)


def test_each_family_is_listed_as_checked_against_this_file():
    table = {row["family"]: row for row in family_table()}
    for name in NAMES:
        assert table[name]["status"] == "parity-checked"
        assert SPECS[name].parity_reference == "tests/families/test_internlm_minicpm_orion_solar.py"


def test_internlm3_reads_transformers_aliases_of_its_bias_keys(tmp_path):
    """A config Transformers' InternLM3Config rewrote states attention_bias (qkv_bias) and mlp_bias
    (bias)."""
    from ster_dist.config import from_hf

    raw = {"model_type": "internlm3", **SIZES, "attention_bias": True, "mlp_bias": False}
    cfg = from_hf(raw)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_up_bias) == (True, False, False)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bskcn_4": None}, "solar needs bskcn_1, bskcn_2, bskcn_3 and bskcn_4"),
        ({"bskcn_tv": [0.9]}, "solar needs bskcn_1"),
        ({"bskcn_3": [1, LAYERS]}, "block_skips must list"),
        # mixed in before anything was kept
        ({"bskcn_1": [2], "bskcn_3": [1]}, "block_skips must list"),
    ],
)
def test_solar_skips_it_cannot_read_are_refused(tmp_path, change, message):
    directory = tmp_path / "m"
    write_checkpoint("solar", directory, **change)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(directory)))
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts": 8, "num_experts_per_tok": 2}, "num_experts is set; MiniCPM-MoE"),
        ({"use_mup": False}, "use_mup is False; MiniCPM without its muP scales"),
    ],
)
def test_minicpm_it_cannot_run_is_refused_before_any_weight(tmp_path, change, message):
    directory = tmp_path / "m"
    write_checkpoint("minicpm", directory, **change)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(directory)))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_peft_adapter_on_internlm2s_fused_wqkv_equals_the_reference_merged_by_hand(tmp_path):
    """A PEFT adapter names InternLM2's own modules (attention.wqkv, feed_forward.w2); its B rows on
    wqkv split into query, key and value by the same grouped layout the loader reads. The reference
    merges W + s * B @ A into the stored tensors and un-fuses them itself."""
    from ster_dist.adapters.attach import attach
    from ster_dist.adapters.format import open_adapter
    from ster_dist.adapters.targets import sites_for

    base = tmp_path / "base"
    weights = write_checkpoint("internlm2", base, seed=7)
    stored = _internlm2_names(weights)
    rank, alpha = 4, 8
    gen = torch.Generator().manual_seed(5)
    factors, merged = {}, dict(stored)
    for name in (
        "model.layers.0.attention.wqkv",
        "model.layers.2.attention.wqkv",
        "model.layers.1.feed_forward.w2",
    ):
        rows, cols = stored[f"{name}.weight"].shape
        a, b = (
            torch.randn(rank, cols, generator=gen) * 0.1,
            torch.randn(rows, rank, generator=gen) * 0.1,
        )
        factors[f"base_model.model.{name}.lora_A.weight"] = a
        factors[f"base_model.model.{name}.lora_B.weight"] = b
        merged[f"{name}.weight"] = stored[f"{name}.weight"] + alpha / rank * b @ a
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["wqkv", "w2"]}
        )
    )
    save_file(factors, str(adapter / "adapter_model.safetensors"))
    reference = _unfuse_internlm2(merged, weights)

    loaded = load_model(resolve(str(base)), "f32")
    ids = _ids(2, 16, seed=4)
    with torch.no_grad():
        want = reference_logits(reference, FAMILIES["internlm2"][0].reference, ids)
        # the adapter changes the logits
        assert compare(loaded.model(ids), want)["max_relative_error"] > 1e-2
        attach(loaded.model, sites_for(open_adapter(adapter), loaded.cfg, str(base)))
        result = compare(loaded.model(ids), want)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, result


def _unfuse_internlm2(stored: dict, canonical: dict) -> dict:
    """The canonical weights with every layer's wqkv and w2 read back from InternLM2's stored
    tensors."""
    out = dict(canonical)
    per_kv = HEADS // KV_HEADS
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        groups = stored[f"{p}attention.wqkv.weight"].reshape(
            KV_HEADS, (per_kv + 2) * HEAD_DIM, HIDDEN
        )
        out[f"{p}self_attn.q_proj.weight"] = groups[:, : per_kv * HEAD_DIM].reshape(-1, HIDDEN)
        out[f"{p}self_attn.k_proj.weight"] = groups[
            :, per_kv * HEAD_DIM : (per_kv + 1) * HEAD_DIM
        ].reshape(-1, HIDDEN)
        out[f"{p}self_attn.v_proj.weight"] = groups[:, (per_kv + 1) * HEAD_DIM :].reshape(
            -1, HIDDEN
        )
        out[f"{p}mlp.down_proj.weight"] = stored[f"{p}feed_forward.w2.weight"]
    return out
