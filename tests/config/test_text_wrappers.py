"""Text wrappers (config_file.TEXT_WRAPPERS): an image-text checkpoint loads as its text family
whenever that family runs, from each layout wrapped weights are stored in, with its towers never
mapped; a wrapper whose text family does not run yet is refused naming that family.

The references are Transformers' own image-text models (Mistral3ForConditionalGeneration,
Kimi_K25ForConditionalGeneration over a DeepSeek-V3 decoder whose text_config says kimi_k2, as
Kimi-K2.5's does, and Llama4ForConditionalGeneration over a llama4_text decoder), built tiny here
and run on text alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ster_dist.config import from_hf
from ster_dist.config.file import TEXT_WRAPPERS, family_of, text_weight_names
from ster_dist.errors import Refusal
from ster_dist.families.registry import spec_for
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import engine_tokens
from tests.tiny.deepseek import TINY as DEEPSEEK_TINY
from tests.tiny.gemma4 import TINY as GEMMA4_TINY
from tests.tiny.llama4 import TINY as LLAMA4_TINY
from tests.tiny_models import BASE_CONFIG
from tests.tiny_tokenizer import build_tiny_tokenizer

# the layouts wrapped weights are published in: (the text model's model.*, its lm_head, a tower's
# root)
LAYOUTS = {
    # Transformers 5 saves
    "transformers5": ("model.language_model.", "lm_head.", "model."),
    # older saves, Kimi-K2.5
    "language_model": ("language_model.model.", "language_model.lm_head.", ""),
    # HCX SEED
    "hyperclovax": ("model.language_model.model.", "model.language_model.lm_head.", "model."),
}


def _rename(name: str, layout: str) -> str:
    """A Transformers 5 state-dict name as the layout stores it."""
    text, head, tower = LAYOUTS[layout]
    if name.startswith("model.language_model."):
        return text + name[len("model.language_model.") :]
    if name.startswith("lm_head."):
        return head + name[len("lm_head.") :]
    assert name.startswith("model."), name
    return tower + name[len("model.") :]


def _as_transformers5(name: str) -> str:
    """A state-dict name of a model that keeps its text model whole below language_model (Llama 4's)
    as Transformers 5's other wrappers name it."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model.") :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    return name if name.startswith(("model.", "lm_head.")) else "model." + name


def _save(model, directory: Path, layout: str, text_model_type: str | None = None) -> Path:
    directory.mkdir(parents=True)
    state = {
        _rename(_as_transformers5(k), layout): v.detach().clone()
        for k, v in model.state_dict().items()
    }
    save_file(state, str(directory / "model.safetensors"))
    config = model.config.to_dict()
    if text_model_type is not None:
        config["text_config"]["model_type"] = text_model_type
    (directory / "config.json").write_text(json.dumps(config))
    build_tiny_tokenizer(directory)
    return directory


def _tiny_mistral3():
    import transformers

    text = transformers.MistralConfig(**BASE_CONFIG, num_key_value_heads=2, head_dim=16)
    vision = transformers.PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    config = transformers.Mistral3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.Mistral3ForConditionalGeneration(config).eval(), None


def _tiny_kimi_k25():
    import transformers
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig

    _, _, kwargs = DEEPSEEK_TINY["deepseek_v3"]
    text = transformers.DeepseekV3Config(**{**BASE_CONFIG, **kwargs})
    vision = Kimi_K25VisionConfig(
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        pos_emb_height=4,
        pos_emb_width=4,
    )
    config = transformers.Kimi_K25Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        projection_hidden_size=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():  # a routed layer's correction bias starts at zero: make it choose
        for name, param in model.named_parameters():
            if "e_score_correction_bias" in name:
                param.copy_(torch.randn(param.shape) * 0.1)
    return model, "kimi_k2"  # Kimi-K2.5's text_config names its decoder kimi_k2


def _tiny_llama4():
    """Llama 4's image-text model over the tiny llama4_text decoder (chunked, unrotated and expert
    layers)."""
    import transformers

    _, _, kwargs = LLAMA4_TINY["llama4_text"]
    text = transformers.Llama4TextConfig(**{**BASE_CONFIG, **kwargs})
    vision = transformers.Llama4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
        vision_output_dim=16,
        projector_input_dim=16,
        projector_output_dim=16,
    )
    config = transformers.Llama4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False
    )
    torch.manual_seed(0)
    return transformers.Llama4ForConditionalGeneration(config).eval(), None


def _tiny_gemma4():
    """Gemma 4's image-text model (a vision tower, never mapped) over the tiny gemma4_text decoder
    (per-layer inputs, shared keys and values)."""
    import transformers

    _, _, kwargs = GEMMA4_TINY["gemma4_text"]
    text = transformers.Gemma4TextConfig(**{**BASE_CONFIG, **kwargs})
    vision = transformers.Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        position_embedding_size=64,
    )
    config = transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None
    )
    torch.manual_seed(0)
    return transformers.Gemma4ForConditionalGeneration(config).eval(), None


def _tiny_gemma4_unified():
    import transformers

    _, _, kwargs = GEMMA4_TINY["gemma4_unified_text"]
    text = transformers.Gemma4UnifiedTextConfig(**{**BASE_CONFIG, **kwargs})
    config = transformers.Gemma4UnifiedConfig(text_config=text.to_dict(), vision_config=None)
    torch.manual_seed(0)
    return transformers.Gemma4UnifiedForConditionalGeneration(config).eval(), None


BUILDERS = {
    "mistral3": _tiny_mistral3,
    "kimi_k25": _tiny_kimi_k25,
    "llama4": _tiny_llama4,
    "gemma4": _tiny_gemma4,
    "gemma4_unified": _tiny_gemma4_unified,
}
CASES = [
    ("mistral3", "transformers5"),
    ("mistral3", "language_model"),
    ("mistral3", "hyperclovax"),
    ("kimi_k25", "language_model"),
    ("kimi_k25", "transformers5"),
    ("llama4", "transformers5"),
    ("llama4", "language_model"),
    ("gemma4", "transformers5"),
    ("gemma4_unified", "transformers5"),
]


@pytest.fixture(scope="module")
def references():
    return {name: build() for name, build in BUILDERS.items()}


@pytest.mark.parametrize("wrapper,layout", CASES)
def test_wrapped_checkpoint_matches_transformers(references, tmp_path, wrapper, layout):
    reference, text_model_type = references[wrapper]
    directory = _save(reference, tmp_path / "model", layout, text_model_type)
    # Transformers' Llama 4 image-text model fails on text alone (its output has no
    if wrapper == "llama4":
        # image_outputs); its language model holds the same text weights
        reference = reference.language_model
    loaded = load_model(resolve(str(directory)), "f32")
    assert loaded.cfg.wrapper == wrapper
    assert loaded.cfg.family == family_of(json.loads((directory / "config.json").read_text()))
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model(ids)
        theirs = reference(input_ids=ids).logits
    result = compare(ours, theirs)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, result
    prompt = ids[:1, :7]
    with torch.no_grad():
        want = reference.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)[
            0, 7:
        ].tolist()
    got = engine_tokens(loaded, [prompt[0].tolist()], 8, loaded.cfg.eos_token_ids)[0]
    assert got == want


def test_kimi_k25_unwraps_to_kimi_k2_read_as_deepseek_v3():
    raw = {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}}
    assert family_of(raw) == "deepseek_v3"
    assert family_of({"model_type": "kimi_k2"}) == "deepseek_v3"
    # Transformers' default
    assert family_of({"model_type": "kimi_k25", "text_config": {}}) == "deepseek_v3"


def test_an_unmapped_tensor_below_the_language_model_is_refused(references, tmp_path):
    reference, _ = references["mistral3"]
    directory = _save(reference, tmp_path / "model", "language_model")
    extra = {
        "language_model.model.layers.0.self_attn.unknown.weight": torch.zeros(2, 2),
        "vision_tower.anything.weight": torch.zeros(2, 2),
    }
    save_file(extra, str(directory / "model-extra.safetensors"))
    with pytest.raises(
        Refusal, match="language_model.model.layers.0.self_attn.unknown.weight is not mapped"
    ):
        load_model(resolve(str(directory)), "f32")


def test_towers_are_never_mapped_and_the_text_model_always_is():
    assert text_weight_names("kimi_k25", "vision_tower.encoder.blocks.0.wqkv.weight") == []
    assert text_weight_names("mistral3", "model.multi_modal_projector.linear_1.weight") == []
    assert text_weight_names("mistral3", "mm_projector.proj.0.weight") == []
    assert "model.layers.0.mlp.up_proj.weight" in text_weight_names(
        "hyperclovax_vision_v2", "model.language_model.model.layers.0.mlp.up_proj.weight"
    )
    assert (
        text_weight_names("qwen3_5", "model.language_model.norm.weight")[0] == "model.norm.weight"
    )
    assert text_weight_names("step3_vl", "model.layers.0.mlp.up_proj.weight") == [
        "model.layers.0.mlp.up_proj.weight"
    ]
    assert text_weight_names("step3_vl", "vision_model.embeddings.patch_embedding.weight") == []


@pytest.mark.parametrize("wrapper", sorted(TEXT_WRAPPERS))
def test_every_wrapper_unwraps_and_waits_for_its_text_family(wrapper):
    """Each wrapper reads as its text family; one whose family does not run is refused naming that
    family, and unwraps with no further change once the family gains a spec."""
    text_family = family_of({"model_type": wrapper, "text_config": {}})
    assert text_family == {"kimi_k2": "deepseek_v3"}.get(
        TEXT_WRAPPERS[wrapper].text_family, TEXT_WRAPPERS[wrapper].text_family
    )
    if spec_for(text_family) is None:
        with pytest.raises(Refusal) as info:
            from_hf({"model_type": wrapper, "text_config": {"model_type": text_family}})
        assert str(info.value).startswith(
            f'model architecture "{text_family}" (the text decoder inside '
            f"{wrapper}) is recognised but not yet runnable"
        )


@pytest.mark.parametrize("wrapper", ["mistral3", "kimi_k25", "qwen3_5"])
def test_a_wrapper_without_text_config_is_refused(wrapper):
    with pytest.raises(Refusal, match=f'model architecture "{wrapper}" is unsupported'):
        family_of({"model_type": wrapper})
