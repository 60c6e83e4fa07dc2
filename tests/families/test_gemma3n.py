"""Gemma 3n beyond tests/families/test_parity.py: the gemma3n wrapper's checkpoints (text model
below model.language_model, towers beside it, the unused keys and values of shared layers that
releases store), capture and steering on AltUp's first copy against Transformers' own decoder
layers, and the refusals of configs the text decoder cannot run. The reference is Transformers'
Gemma3nForCausalLM on the tiny checkpoint of tests/tiny/gemma3n.py (Transformers' image-audio-text
model needs timm for its vision tower)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.steer.attach import add_steering
from ster_dist.steer.capture import read_hidden
from tests.engine_checks import engine_tokens
from tests.tiny_models import make_tiny, read_config
from tests.tiny_tokenizer import build_tiny_tokenizer

SHARED_LAYER = 2  # tests/tiny/gemma3n.py: layers 2 and 3 attend layers 0's and 1's keys and values


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3n_text")
    reference = make_tiny("gemma3n_text", directory)
    return reference, directory, load_model(resolve(str(directory)), "f32")


def _ids(rows: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(3, 300, (rows, length), generator=torch.Generator().manual_seed(0))


def test_the_wrapper_loads_its_language_model_and_leaves_towers_and_shared_keys_unread(
    tiny, tmp_path
):
    reference, directory, _ = tiny
    state = {
        (
            "model.language_model." + k[len("model.") :] if k.startswith("model.") else k
        ): v.detach().clone()
        # the head is tied
        for k, v in reference.state_dict().items()
        if k != "lm_head.weight"
    }
    hidden, kv_rows = (
        reference.config.hidden_size,
        reference.config.num_key_value_heads * reference.config.head_dim,
    )
    # what releases hold beside the text model: towers, and the never-read keys and values of shared
    # layers
    state.update(
        {
            "model.audio_tower.conformer.0.ffw_layer_start.ffw_layer_1.weight": torch.zeros(4, 4),
            "model.embed_vision.embedding.weight": torch.zeros(4, hidden),
            f"model.language_model.layers.{SHARED_LAYER}.self_attn.k_proj.weight": torch.zeros(
                kv_rows, hidden
            ),
            f"model.language_model.layers.{SHARED_LAYER}.self_attn.v_proj.weight": torch.zeros(
                kv_rows, hidden
            ),
            f"model.language_model.layers.{SHARED_LAYER}.self_attn.k_norm.weight": torch.zeros(16),
        }
    )
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    save_file(state, str(wrapped / "model.safetensors"))
    text = read_config(directory)
    (wrapped / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gemma3n",
                "architectures": ["Gemma3nForConditionalGeneration"],
                "text_config": text,
                "vision_config": {},
                "audio_config": {},
            }
        )
    )
    build_tiny_tokenizer(wrapped)
    loaded = load_model(resolve(str(wrapped)), "f32")
    assert (loaded.cfg.wrapper, loaded.cfg.family) == ("gemma3n", "gemma3n_text")
    ids = _ids()
    with torch.no_grad():
        result = compare(loaded.model(ids), reference(ids).logits)
    assert result["max_relative_error"] < 1e-4, result
    prompt = ids[0, :6].tolist()
    with torch.no_grad():
        want = reference.generate(input_ids=ids[:1, :6], max_new_tokens=6, do_sample=False)[
            0, 6:
        ].tolist()
    assert engine_tokens(loaded, [prompt], 6, loaded.cfg.eos_token_ids)[0] == want


def _first_copies(reference, ids: torch.Tensor, shift: dict[int, torch.Tensor] | None = None):
    """Transformers' first AltUp copy after each decoder layer (shifted there by `shift`), and its
    logits."""
    seen: dict[int, torch.Tensor] = {}

    def hook(layer: int):
        def after(module, args, output):
            if shift and layer in shift:
                output = torch.cat(((output[0] + shift[layer]).unsqueeze(0), output[1:]))
            seen[layer] = output[0].clone()
            return output

        return after

    handles = [
        block.register_forward_hook(hook(i)) for i, block in enumerate(reference.model.layers)
    ]
    try:
        with torch.no_grad():
            logits = reference(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen, logits


def test_capture_reads_altup_first_copy(tiny):
    reference, _, loaded = tiny
    ids = _ids(1)
    theirs, _ = _first_copies(reference, ids)
    layers = [0, SHARED_LAYER, 3]
    ours = read_hidden(loaded.model, [ids[0].tolist()], layers, "all")
    for layer in layers:
        result = compare(ours[layer], theirs[layer][0])
        assert result["max_relative_error"] < 1e-4, (layer, result)


def test_steering_shifts_altup_first_copy(tiny):
    reference, _, loaded = tiny
    ids = _ids()
    vector = torch.randn(loaded.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    _, plain = _first_copies(reference, ids)
    _, shifted = _first_copies(reference, ids, {1: vector * 2.0})
    removers = add_steering(loaded.model, [(1, vector)], 2.0)
    try:
        with torch.no_grad():
            ours = loaded.model(ids)
    finally:
        for remove in removers:
            remove()
    assert compare(plain, shifted)["max_relative_error"] > 1e-2  # the shift shows
    assert compare(ours, shifted)["max_relative_error"] < 1e-4


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"altup_active_idx": 1},
            "altup_active_idx is 1; the blocks run on AltUp's first copy only",
        ),
        (
            {"intermediate_size": [80, 96, 80, 80]},
            "intermediate_size gives layers different widths [80, 96]",
        ),
        (
            {"num_kv_shared_layers": 3},
            "num_kv_shared_layers 3 leaves no earlier full_attention layer",
        ),
        (
            {"activation_sparsity_pattern": [0.95, 0.5]},
            "activation_sparsity_pattern must give a sparsity in [0, 1) for each of the 4 layers",
        ),
    ],
)
def test_configs_the_decoder_cannot_run_are_refused(tiny, change, message):
    _, directory, _ = tiny
    with pytest.raises(Refusal, match=re.escape(message)):
        from_hf({**read_config(directory), **change})
