"""MTP drafts beyond DeepSeek-V3 (model/mtp.py's layouts), in the token engine: greedy output with
drafts equals greedy output without, and an MTP layer made to echo its input token gets drafts
accepted.

- GLM-4.5 (glm4_moe) stores its MTP layer as DeepSeek-V3 does (model.layers.{num_hidden_layers}:
  enorm, hnorm, eh_proj, shared_head and a sparse decoder layer); tests/engine/test_speculative.py
  writes it. So does GLM-4.7-Flash (glm4_moe_lite), whose mlp_layer_types, like a layer_types list,
  gains the MTP layer's entry.
- MiMo (mimo) stores its own apart (model.mtp_layers.0: token_layernorm, hidden_layernorm,
  input_proj over [hidden; embedding], a Qwen2 block, final_layernorm; the model's lm_head scores
  it). Its draft logits, and a chained draft's, are checked against a forward written here from the
  same tensors, Transformers' Qwen2 decoder layer as its block.
- A text wrapper (Kimi-K2.5's kimi_k25 around a DeepSeek-V3 text_config) states its MTP count inside
  text_config: `ster inspect-model` and `ster plan` report it and --speculative mtp drafts with the
  layer, stored below language_model; a wrapper whose text_config states none is still refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.cli import main
from ster_dist.config.load import model_config
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.mtp import mtp_config
from ster_dist.model.paged import Chunk
from ster_dist.parallel.ctx import SINGLE
from ster_dist.resolve import resolve
from ster_dist.load.mtp import load_mtp
from tests.families.test_telechat_mimo_pangu_nanbeige import SIZES, _noisy
from tests.engine.test_engine import open_engine
from tests.engine.test_speculative import drafts_keep_greedy, with_mtp
from tests.tiny_tokenizer import build_tiny_tokenizer

MIMO_MTP = "model.mtp_layers.0."


@pytest.fixture(scope="module")
def glm_echo(tmp_path_factory):
    return with_mtp(tmp_path_factory.mktemp("glm4_moe_echo"), echo=True, family="glm4_moe")


def test_glm4_moes_mtp_layer_is_a_sparse_layer(glm_echo):
    """first_k_dense_replace counts the MTP layer among the sparse ones, as Transformers'
    Glm4MoeConfig would."""
    cfg = model_config(resolve(str(glm_echo)))
    raw = json.loads((glm_echo / "config.json").read_text())
    assert raw["first_k_dense_replace"] < cfg.num_layers
    ext = mtp_config(cfg, raw)
    assert ext.num_layers == cfg.num_layers + 1
    assert ext.feed_forward(cfg.num_layers) == cfg.feed_forward(cfg.num_layers - 1) == "moe"


def test_per_layer_lists_gain_the_mtp_layer():
    """A config listing its layers' kinds (Transformers writes layer_types into re-saved Qwen2
    configs, GLM-4.7-Flash states mlp_layer_types) is read with the MTP layer a full-attention,
    sparse one."""
    from ster_dist.config import from_hf

    mimo = {
        "model_type": "mimo",
        "architectures": ["MiMoForCausalLM"],
        **SIZES,
        "hidden_act": "silu",
        "num_nextn_predict_layers": 1,
        "layer_types": ["full_attention"] * SIZES["num_hidden_layers"],
    }
    ext = mtp_config(from_hf(mimo), mimo)
    assert (
        ext.num_layers == SIZES["num_hidden_layers"] + 1
        and ext.mixer(ext.num_layers - 1) == "attention"
    )


def test_glm_4_7_flashs_mtp_layer_is_sparse_past_its_mlp_layer_types_and_drafts(tmp_path):
    """GLM-4.7-Flash (glm4_moe_lite: latent attention, mlp_layer_types naming each layer's
    feed-forward)."""
    directory = with_mtp(tmp_path, echo=True, family="glm4_moe_lite")
    cfg = model_config(resolve(str(directory)))
    raw = json.loads((directory / "config.json").read_text())
    assert len(raw["mlp_layer_types"]) == cfg.num_layers
    assert mtp_config(cfg, raw).feed_forward(cfg.num_layers) == "moe"
    drafts_keep_greedy(directory, 2, accepted=False)


def test_glm4_moes_echoing_mtp_layer_drafts_and_keeps_greedy_output(glm_echo):
    drafts_keep_greedy(glm_echo, 2, accepted=True)


def with_mimo_mtp(directory: Path, echo: bool = False) -> Path:
    """A tiny MiMo: Transformers' Qwen2 under model_type mimo, one MTP layer (a copy of its last
    layer as the block, random norms and input_proj); `echo`: input_proj passes the normed embedding
    alone, the block adds nothing, and the head (the model's, tied to the embedding here) reads the
    token again."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**{**SIZES, "tie_word_embeddings": echo})
    ).eval()
    _noisy(model)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if echo:
        tensors.pop("lm_head.weight", None)
    hidden, last = SIZES["hidden_size"], f"model.layers.{SIZES['num_hidden_layers'] - 1}."
    tensors.update(
        {MIMO_MTP + n[len(last) :]: t.clone() for n, t in tensors.items() if n.startswith(last)}
    )
    g = torch.Generator().manual_seed(5)
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        tensors[f"{MIMO_MTP}{norm}.weight"] = (
            torch.ones(hidden) if echo else 1 + torch.randn(hidden, generator=g) * 0.2
        )
    tensors[MIMO_MTP + "input_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.2
    if echo:
        for name in list(tensors):
            if name.startswith(MIMO_MTP) and name.endswith(
                ("o_proj.weight", "o_proj.bias", "down_proj.weight")
            ):
                tensors[name] = torch.zeros_like(tensors[name])
        tensors[MIMO_MTP + "input_proj.weight"] = torch.cat(
            (torch.zeros(hidden, hidden), torch.eye(hidden)), 1
        )
    config = {
        "model_type": "mimo",
        "architectures": ["MiMoForCausalLM"],
        **SIZES,
        "hidden_act": "silu",
        "tie_word_embeddings": echo,
        "num_nextn_predict_layers": 1,
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    build_tiny_tokenizer(directory, vocab_size=SIZES["vocab_size"])
    return directory


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return with_mimo_mtp(tmp_path_factory.mktemp("mimo_mtp"))


@pytest.fixture(scope="module")
def mimo_echo(tmp_path_factory):
    return with_mimo_mtp(tmp_path_factory.mktemp("mimo_echo"), echo=True)


def mimo_reference(
    directory: Path, hidden: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """MiMo's MTP layer over one sequence from position 0 (vLLM's mimo_mtp), from the checkpoint's
    tensors: rows q read the model's hidden state hidden[q] and token ids[q] (the one after q), the
    embedding zero at position 0; (the layer's output [n, hidden], logits [n, vocab])."""
    import transformers
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    tensors = load_file(str(directory / "model.safetensors"))
    config = transformers.Qwen2Config(**SIZES)
    config._attn_implementation = "eager"
    block = Qwen2DecoderLayer(config, 0).eval()
    block.load_state_dict(
        {
            n[len(MIMO_MTP) :]: t
            for n, t in tensors.items()
            if n.startswith(MIMO_MTP) and n[len(MIMO_MTP) :] in block.state_dict()
        }
    )

    def rms(x, name):
        return (
            x
            * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + SIZES["rms_norm_eps"])
            * tensors[f"{MIMO_MTP}{name}.weight"]
        )

    n = len(ids)
    embed = tensors["model.embed_tokens.weight"][ids]
    embed[0] = 0
    x = (
        torch.cat((rms(hidden, "hidden_layernorm"), rms(embed, "token_layernorm")), -1)
        @ tensors[MIMO_MTP + "input_proj.weight"].T
    )
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        y = block(
            x[None],
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=Qwen2RotaryEmbedding(config)(x[None], positions),
        )[0]
    y = rms(y, "final_layernorm")
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    return y, y @ head.T


def test_mimos_draft_logits_and_a_chained_drafts_equal_the_reference(mimo):
    loaded = load_model(resolve(str(mimo)), "f32")
    draft = load_mtp(loaded, SINGLE)
    g = torch.Generator().manual_seed(3)
    n = 7
    hidden, ids = (
        torch.randn(n, SIZES["hidden_size"], generator=g),
        torch.randint(3, 300, (n,), generator=g),
    )
    cache = draft.new_cache(8, 4)
    blocks = (1, 2, 3)
    with torch.no_grad():
        y, logits = draft.forward_paged(loaded.model, hidden, ids, [Chunk(blocks, 0, n)], cache)
    want_y, want_logits = mimo_reference(mimo, hidden, ids)
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], want_logits[-1], atol=1e-4, rtol=1e-4)
    # a chained draft: the layer's own (normed) output and its argmax as the next row, the cache
    # holding the rest
    token = logits[0].argmax().reshape(1)
    with torch.no_grad():
        _, chained = draft.forward_paged(loaded.model, y[-1:], token, [Chunk(blocks, n, 1)], cache)
    _, want_chained = mimo_reference(
        mimo, torch.cat((hidden, want_y[-1:])), torch.cat((ids, token))
    )
    torch.testing.assert_close(chained[0], want_chained[-1], atol=1e-4, rtol=1e-4)


def test_mimo_decodes_without_reading_its_mtp_layer_and_drafts_with_it(mimo):
    """Plain decoding ignores model.mtp_layers (families/mimo.py); --speculative mtp reads them, and
    greedy output is unchanged."""
    drafts_keep_greedy(mimo, 3, accepted=False)


def test_mimos_echoing_mtp_layer_gets_drafts_accepted(mimo_echo):
    drafts_keep_greedy(mimo_echo, 2, accepted=True)


def wrapped(directory: Path, mtp: bool = True) -> Path:
    """tests/engine/test_speculative.py's DeepSeek-V3 with an echoing MTP layer, saved as Kimi-K2.5
    saves its text model: the config under text_config (model_type kimi_k2), every tensor below
    language_model; `mtp` False: the text_config states no MTP layer and the checkpoint holds
    none."""
    with_mtp(directory, echo=True)
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    layers = config["num_hidden_layers"]
    if not mtp:
        config.pop("num_nextn_predict_layers")
        tensors = {n: t for n, t in tensors.items() if not n.startswith(f"model.layers.{layers}.")}
    save_file(
        {f"language_model.{n}": t for n, t in tensors.items()}, str(directory / "model.safetensors")
    )
    outer = {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {**config, "model_type": "kimi_k2"},
    }
    (directory / "config.json").write_text(json.dumps(outer))
    return directory


def cli(capsys, *argv) -> dict:
    # not the command's: what building the checkpoint printed (DeepSpeed's accelerator probe)
    capsys.readouterr()
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_a_wrapped_configs_mtp_layer_is_reported_planned_and_drafts(tmp_path, capsys):
    directory = wrapped(tmp_path / "kimi_k25")
    assert cli(capsys, "inspect-model", "--model", str(directory))["config"]["mtp_layers"] == 1
    names = load_file(str(directory / "model.safetensors"))
    layers = json.loads((directory / "config.json").read_text())["text_config"]["num_hidden_layers"]
    stored = [n for n in names if n.startswith(f"language_model.model.layers.{layers}.")]
    assert stored and cli(capsys, "plan", "--model", str(directory))["mtp_tensors"] == len(stored)
    # the echoing layer was read, below language_model
    drafts_keep_greedy(directory, 2, accepted=True)


def test_a_wrapped_config_without_mtp_layers_is_still_refused(tmp_path):
    directory = wrapped(tmp_path / "kimi_k25", mtp=False)
    assert model_config(resolve(str(directory))).mtp_layers == 0
    with pytest.raises(Refusal, match="num_nextn_predict_layers"):
        open_engine(directory, speculative_tokens=1)


def test_mimos_stored_mtp_layers_are_planned_apart(mimo, capsys):
    names = load_file(str(mimo / "model.safetensors"))
    stored = [n for n in names if n.startswith(MIMO_MTP)]
    assert cli(capsys, "plan", "--model", str(mimo))["mtp_tensors"] == len(stored) > 0
