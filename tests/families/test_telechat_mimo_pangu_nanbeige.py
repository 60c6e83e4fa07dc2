"""telechat, telechat3, TeleFLM, mimo, PanguEmbedded and nanbeige (families/telechat.py, mimo.py,
pangu.py and looped.py) against references written here from seeds/000's description, since
Transformers has none of their classes.

Where the block is Transformers' own, the reference is that class on the same weights, written into
the checkpoint under the family's names by a map below: TeleChat is Llama with zero
query/key/value/gate/up biases (its key_value rows interleaved per key-value head), TeleChat3 is
Llama whose YaRN temperature is 0.07 ln(factor) + 1 (passed to Transformers as attention_factor, the
checkpoint stating telechat3-yarn), TeleFLM is Llama with its embeddings and logits multiplied here,
MiMo is Qwen2 beside random MTP tensors, openPangu-Embedded without sandwich_norm is Llama with
every attention projection biased. openPangu-Embedded under sandwich_norm and Nanbeige (a looped
model: its stored layers run num_loops times) have no Transformers counterpart, so a plain-torch
forward below is their reference.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

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
from tests.tiny_tokenizer import build_tiny_tokenizer

SIZES = dict(
    vocab_size=384,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
YARN = {"rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
MUP = {"use_mup": True, "input_mult": 3.0, "output_mult": 2.0, "mup_scale_factor": 4.0}
VARIANTS = (
    "telechat",
    "telechat3",
    "TeleFLM",
    "mimo",
    "PanguEmbedded",
    "PanguEmbedded-sandwich",
    "nanbeige",
    "nanbeige-skip-norm",
)
FAMILIES = ("telechat", "telechat3", "TeleFLM", "mimo", "PanguEmbedded", "nanbeige")


@dataclass
class Reference:
    """A reference forward over token ids: logits, and greedy decoding by whole re-reads (no
    cache)."""

    forward: object

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.forward(ids)

    def greedy(self, prompt: list[int], n: int, eos: int) -> list[int]:
        return greedy_by_rereading(self.forward, prompt, n, eos)


def _noisy(model: torch.nn.Module) -> None:
    """Norms away from one and biases away from zero, so a tensor read into the wrong place
    shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn(param.shape) * 0.2)


def _llama(**config):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES, **config})).eval()
    _noisy(model)
    return model


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _telechat(model) -> tuple[dict, dict]:
    """Llama with attention_bias and mlp_bias, the biases TeleChat lacks zeroed, under TeleChat's
    names."""
    state, hd, kv = _state(model), 8, SIZES["num_key_value_heads"]
    out = {
        "transformer.word_embeddings.weight": state.pop("model.embed_tokens.weight"),
        "transformer.ln_f.weight": state.pop("model.norm.weight"),
        "lm_head.weight": state.pop("lm_head.weight"),
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(
                name.endswith(f"{p}.bias")
                for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
            ):
                param.zero_()
    for i in range(SIZES["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        k, v = state[f"{src}self_attn.k_proj.weight"], state[f"{src}self_attn.v_proj.weight"]
        out[f"{dst}self_attention.key_value.weight"] = torch.cat(
            [torch.cat([k[h * hd : (h + 1) * hd], v[h * hd : (h + 1) * hd]]) for h in range(kv)]
        ).contiguous()
        out[f"{dst}self_attention.query.weight"] = state[f"{src}self_attn.q_proj.weight"]
        for ours, theirs in (
            ("self_attention.dense", "self_attn.o_proj"),
            ("mlp.down_proj", "mlp.down_proj"),
        ):
            for kind in ("weight", "bias"):
                out[f"{dst}{ours}.{kind}"] = state[f"{src}{theirs}.{kind}"]
        for name in ("mlp.gate_proj", "mlp.up_proj"):
            out[f"{dst}{name}.weight"] = state[f"{src}{name}.weight"]
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[f"{dst}{name}.weight"] = state[f"{src}{name}.weight"]
    config = {
        "model_type": "telechat",
        "architectures": ["TeleChat2ForCausalLM"],
        "hidden_size": 32,
        "n_head": 4,
        "num_key_value_heads": 2,
        "n_layer": 2,
        "ffn_hidden_size": 48,
        "layer_norm_epsilon": 1e-5,
        "seq_length": 128,
        "vocab_size": 384,
        "tie_word_embeddings": False,
        "apply_residual_connection_post_layernorm": False,
        "embed_layernorm": False,
        "rope_scaling": {"type": "dynamic", "factor": 2.0},
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return out, config


def _plain_llama(model, config: dict) -> tuple[dict, dict]:
    return _state(model), config


def _plain_forward(
    state: dict, ids: torch.Tensor, sandwich: bool = False, loops: int = 1, pass_norm: bool = False
) -> torch.Tensor:
    """Llama's block written out, with what seeds/000 adds. openPangu-Embedded under sandwich_norm:
    biased attention projections and mlp_bias, attention's output normed by
    post_attention_layernorm, the feed-forward reading pre_mlp_layernorm and its output normed by
    post_mlp_layernorm. Nanbeige: each head's query and key RMS-normed by q_layernorm and
    k_layernorm before the rotation, the stored layers run `loops` times, the final norm closing
    every pass under `pass_norm`."""
    heads, kv, hd, eps = 4, 2, 8, SIZES["rms_norm_eps"]

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * state[f"{name}.weight"]

    def linear(x, name):
        return F.linear(x, state[f"{name}.weight"], state.get(f"{name}.bias"))

    b, t = ids.shape
    inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rotate(x):
        half = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos + half * sin

    def heads_of(x, name, count):
        x = linear(x, name).view(b, t, count, hd)
        norm = name.replace("_proj", "_layernorm")
        return (rms(x, norm) if f"{norm}.weight" in state else x).transpose(1, 2)

    h = state["model.embed_tokens.weight"][ids]
    for loop in range(loops):
        for i in range(SIZES["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = rms(h, f"{p}input_layernorm")
            q = rotate(heads_of(x, f"{p}self_attn.q_proj", heads))
            k = rotate(heads_of(x, f"{p}self_attn.k_proj", kv))
            v = linear(x, f"{p}self_attn.v_proj").view(b, t, kv, hd).transpose(1, 2)
            k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
            scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            a = linear(
                (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, heads * hd),
                f"{p}self_attn.o_proj",
            )
            h = h + (rms(a, f"{p}post_attention_layernorm") if sandwich else a)
            x = rms(h, f"{p}pre_mlp_layernorm" if sandwich else f"{p}post_attention_layernorm")
            m = linear(
                F.silu(linear(x, f"{p}mlp.gate_proj")) * linear(x, f"{p}mlp.up_proj"),
                f"{p}mlp.down_proj",
            )
            h = h + (rms(m, f"{p}post_mlp_layernorm") if sandwich else m)
        if pass_norm and loop < loops - 1:
            h = rms(h, "model.norm")
    return linear(rms(h, "model.norm"), "lm_head")


def _random_state(
    sandwich: bool = False, biased: bool = False, qk_norm: bool = False
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    hidden, inner, hd = SIZES["hidden_size"], SIZES["intermediate_size"], 8

    def r(*shape, scale=0.2, base=0.0):
        return (base + torch.randn(*shape, generator=g) * scale).contiguous()

    state = {
        "model.embed_tokens.weight": r(384, hidden, scale=1.0),
        "model.norm.weight": r(hidden, base=1.0),
        "lm_head.weight": r(384, hidden),
    }
    norms = ("input_layernorm", "post_attention_layernorm") + (
        ("pre_mlp_layernorm", "post_mlp_layernorm") if sandwich else ()
    )
    for i in range(SIZES["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows, cols in (
            ("self_attn.q_proj", 4 * hd, hidden),
            ("self_attn.k_proj", 2 * hd, hidden),
            ("self_attn.v_proj", 2 * hd, hidden),
            ("self_attn.o_proj", hidden, 4 * hd),
            ("mlp.gate_proj", inner, hidden),
            ("mlp.up_proj", inner, hidden),
            ("mlp.down_proj", hidden, inner),
        ):
            state[f"{p}{name}.weight"] = r(rows, cols)
            if biased:
                state[f"{p}{name}.bias"] = r(rows)
        for name in norms:
            state[f"{p}{name}.weight"] = r(hidden, base=1.0)
        if qk_norm:
            state[f"{p}self_attn.q_layernorm.weight"] = r(hd, base=1.0)
            state[f"{p}self_attn.k_layernorm.weight"] = r(hd, base=1.0)
    return state


def _llama_config(model_type: str, architecture: str, **extra) -> dict:
    return {
        "model_type": model_type,
        "architectures": [architecture],
        **SIZES,
        "hidden_act": "silu",
        **extra,
    }


def make(variant: str, directory: Path) -> Reference:
    """Write the variant's tiny checkpoint (config.json, model.safetensors, a tokenizer) and return
    its reference."""
    if variant == "telechat":
        model = _llama(attention_bias=True, mlp_bias=True)
        tensors, config = _telechat(model)
        reference = Reference(lambda ids: model(ids).logits)
    elif variant == "telechat3":
        # the seed's temperature for telechat3-yarn
        attention_factor = 0.07 * math.log(YARN["factor"]) + 1.0
        model = _llama(
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "yarn", **YARN, "attention_factor": attention_factor},
        )
        tensors = _state(model)
        config = _llama_config(
            "telechat3",
            "TeleChat3ForCausalLM",
            attention_bias=True,
            mlp_bias=True,
            rope_scaling={"rope_type": "telechat3-yarn", **YARN},
        )
        reference = Reference(lambda ids: model(ids).logits)
    elif variant == "TeleFLM":
        model = _llama()
        tensors = _state(model)
        config = _llama_config("TeleFLM", "TeleFLMForCausalLM", **MUP)

        # muP: embeddings times input_mult, logits times output_mult / mup_scale_factor
        def teleflm(ids):
            embeds = model.model.embed_tokens(ids) * MUP["input_mult"]
            return model(inputs_embeds=embeds).logits * (
                MUP["output_mult"] / MUP["mup_scale_factor"]
            )

        reference = Reference(teleflm)
    elif variant == "mimo":
        import transformers

        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES)).eval()
        _noisy(model)
        tensors = _state(model)
        g = torch.Generator().manual_seed(5)
        for name, shape in (
            ("input_layernorm.weight", (32,)),
            ("token_layernorm.weight", (32,)),
            ("hidden_layernorm.weight", (32,)),
            ("input_proj.weight", (32, 64)),
            ("self_attn.q_proj.weight", (32, 32)),
            ("self_attn.q_proj.bias", (32,)),
            ("mlp.down_proj.weight", (32, 48)),
            ("final_layernorm.weight", (32,)),
        ):
            tensors[f"model.mtp_layers.0.{name}"] = torch.randn(*shape, generator=g)
        config = _llama_config("mimo", "MiMoForCausalLM", num_nextn_predict_layers=1)
        reference = Reference(lambda ids: model(ids).logits)
    elif variant == "PanguEmbedded":
        model = _llama(attention_bias=True, mlp_bias=True)
        tensors = _state(model)
        config = _llama_config(
            "PanguEmbedded", "PanguEmbeddedForCausalLM", mlp_bias=True, sandwich_norm=False
        )
        reference = Reference(lambda ids: model(ids).logits)
    elif variant == "PanguEmbedded-sandwich":
        tensors = _random_state(sandwich=True, biased=True)
        config = _llama_config(
            "PanguEmbedded",
            "PanguEmbeddedForCausalLM",
            mlp_bias=True,
            qkv_bias=True,
            sandwich_norm=True,
        )
        reference = Reference(lambda ids: _plain_forward(tensors, ids, sandwich=True))
    else:  # nanbeige: two passes over the stored layers, the final norm between them unless skipped
        skip = variant == "nanbeige-skip-norm"
        tensors = _random_state(qk_norm=True)
        config = _llama_config(
            "nanbeige",
            "NanbeigeForCausalLM",
            qk_layernorm=True,
            num_loops=2,
            skip_loop_final_norm=skip,
        )
        reference = Reference(lambda ids: _plain_forward(tensors, ids, loops=2, pass_norm=not skip))
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    build_tiny_tokenizer(directory, vocab_size=SIZES["vocab_size"])
    return reference


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    for variant in VARIANTS:
        directory = tmp_path_factory.mktemp(variant)
        reference = make(variant, directory)
        out[variant] = (directory, reference, load_model(resolve(str(directory)), "f32"))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_tokens_match_the_reference(built, variant):
    _, reference, loaded = built[variant]
    assert loaded.cfg.family == variant.split("-")[0]
    ids = random_ids(2, 40)  # past telechat3's original_max_position_embeddings
    with torch.no_grad():
        ours = loaded.model(ids)
    result = compare(ours, reference.logits(ids))
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, (variant, result)
    prompt = random_ids(1, 7, seed=1)[0].tolist()
    eos = loaded.cfg.eos_token_ids
    want = reference.greedy(prompt, 12, eos[0])
    assert engine_tokens(loaded, [prompt], 12, eos)[0] == want, variant


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_from_cache_equals_reading_whole_and_batches_equal_one_by_one(built, variant):
    check_cache_and_batches(built[variant][2], variant)


def test_tp2_equals_tp1(built):
    """Every variant on a spawned gloo group of two ranks: the key-value heads split one per rank,
    TeleChat's interleaved key_value rows read per head."""
    check_tp2_equals_tp1(
        {variant: (directory, loaded) for variant, (directory, _, loaded) in built.items()}
    )


@pytest.mark.parametrize("variant", ["telechat", "PanguEmbedded-sandwich", "nanbeige"])
def test_the_token_engine_answers_as_the_reference_does(built, variant):
    directory, reference, loaded = built[variant]
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = Tokenizer.from_directory(directory).encode(prompt)
    want = reference.greedy(ids, 8, loaded.cfg.eos_token_ids[0])
    got = cli_generate(
        f"--model={directory}", f"--prompt={prompt}", "--chat-template=off", "--max-new-tokens=8"
    )
    assert got["prompt_tokens"] == len(ids)
    assert got["text"] == Tokenizer.from_directory(directory).decode(
        [t for t in want if t not in loaded.cfg.eos_token_ids]
    )


@pytest.mark.parametrize("variant", ["nanbeige", "nanbeige-skip-norm"])
def test_a_looped_model_counts_every_pass_and_holds_its_stored_weights_once(built, variant):
    directory, _, loaded = built[variant]
    stored = SIZES["num_hidden_layers"]
    assert (loaded.cfg.num_layers, loaded.cfg.loop_layers) == (2 * stored, stored)
    assert loaded.cfg.loop_pass_norm == (variant == "nanbeige")
    tensors = load_file(str(directory / "model.safetensors"))
    assert sum(p.numel() for p in loaded.model.parameters()) == sum(
        t.numel() for t in tensors.values()
    )
    second = loaded.model.layers[stored].token_mixer.q.weight
    assert second is loaded.model.layers[0].token_mixer.q.weight


def test_ster_families_lists_each_family_as_parity_checked_against_this_file():
    rows = {row["family"]: row for row in family_table()}
    for family in FAMILIES:
        assert rows[family]["status"] == "parity-checked"
        assert rows[family]["reference"] == "tests/families/test_telechat_mimo_pangu_nanbeige.py"


@pytest.mark.parametrize(
    "variant, change, message",
    [
        (
            "telechat",
            {"apply_residual_connection_post_layernorm": True},
            "apply_residual_connection_post_layernorm",
        ),
        ("telechat", {"embed_layernorm": True}, "embed_layernorm is set"),
        ("TeleFLM", {"output_mult": None}, "use_mup is set without output_mult"),
        ("TeleFLM", {"mup_scale_factor": 0}, "mup_scale_factor is 0"),
        (
            "telechat3",
            {"rope_scaling": {"rope_type": "telechat3-yarn", "factor": "big"}},
            "telechat3-yarn states factor",
        ),
        ("nanbeige", {"num_loops": 0}, "num_loops is 0"),
    ],
)
def test_what_these_families_cannot_state_is_refused_before_any_weight(
    built, tmp_path, variant, change, message
):
    source = built[variant][0]
    config = {**json.loads((source / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None})
    )
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    build_tiny_tokenizer(tmp_path, vocab_size=SIZES["vocab_size"])
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(tmp_path)))
    assert message in str(refused.value) and "\n" not in str(refused.value)
