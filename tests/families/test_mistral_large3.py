"""Mistral Large 3 in Mistral's own format (params.json + consolidated.safetensors) loads as
deepseek_v3 with Llama 4's query temperature (config_params._large3, families/mistral_format.py).
The reference is Transformers' Mistral4ForCausalLM (the same block: latent attention, softmax
experts renormalised beside a shared one, YaRN, llama_4_scaling_beta), built tiny here and written
in Mistral's names as vLLM's MistralLarge3ForCausalLM reads them; the sequence runs past
original_max_position_embeddings, so the temperature is exercised.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from tests.cli_run import cli_generate
from tests.engine_checks import engine_tokens
from tests.tiny_tokenizer import build_tiny_tokenizer

ORIGINAL = 16  # original_max_position_embeddings: the temperature steps at positions 16 and 48
SIZES = dict(
    vocab_size=385,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    n_routed_experts=6,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=16,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 1.0,
}
_NATIVE = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attention.wq_a",
    "self_attn.q_a_layernorm": "attention.q_a_norm",
    "self_attn.q_b_proj": "attention.wq_b",
    "self_attn.kv_a_proj_with_mqa": "attention.wkv_a_with_mqa",
    "self_attn.kv_a_layernorm": "attention.kv_a_norm",
    "self_attn.kv_b_proj": "attention.wkv_b",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.gate": "gate",
    "mlp.shared_experts.gate_proj": "shared_experts.w1",
    "mlp.shared_experts.up_proj": "shared_experts.w3",
    "mlp.shared_experts.down_proj": "shared_experts.w2",
}


def native_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Transformers' Mistral4 state dict under Mistral's own names (vLLM's MistralLarge3ForCausalLM
    remapping)."""
    top = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    out = {}
    for name, tensor in state.items():
        if name in top:
            out[top[name]] = tensor
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        # [experts, 2 * inner, hidden]: gate rows, then up rows
        if rest == "mlp.experts.gate_up_proj":
            inner = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"layers.{layer}.experts.{e}.w1.weight"] = tensor[e, :inner]
                out[f"layers.{layer}.experts.{e}.w3.weight"] = tensor[e, inner:]
        elif rest == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"layers.{layer}.experts.{e}.w2.weight"] = tensor[e]
        else:
            module, kind = rest.rsplit(".", 1)
            out[f"layers.{layer}.{_NATIVE[module]}.{kind}"] = tensor
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def params_json() -> dict:
    s = SIZES
    return {
        "dim": s["hidden_size"],
        "n_layers": s["num_hidden_layers"],
        "n_heads": s["num_attention_heads"],
        "n_kv_heads": s["num_key_value_heads"],
        "hidden_dim": s["intermediate_size"],
        "norm_eps": s["rms_norm_eps"],
        "vocab_size": s["vocab_size"],
        "rope_theta": ROPE["rope_theta"],
        "tied_embeddings": False,
        "max_position_embeddings": s["max_position_embeddings"],
        **{
            k: s[k]
            for k in (
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
            )
        },
        "moe": {
            "num_experts": s["n_routed_experts"],
            "num_experts_per_tok": s["num_experts_per_tok"],
            "num_shared_experts": s["n_shared_experts"],
            "expert_hidden_dim": s["moe_intermediate_size"],
            "first_k_dense_replace": s["first_k_dense_replace"],
            "routed_scale": s["routed_scaling_factor"],
        },
        "yarn": {
            "factor": ROPE["factor"],
            "original_max_position_embeddings": ORIGINAL,
            "beta": ROPE["beta_fast"],
            "alpha": ROPE["beta_slow"],
        },
        "llama_4_scaling": {
            "original_max_position_embeddings": ORIGINAL,
            "beta": ROPE["llama_4_scaling_beta"],
        },
    }


@pytest.fixture(scope="module")
def large3(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    reference = transformers.Mistral4ForCausalLM(
        transformers.Mistral4Config(**SIZES, rope_parameters=dict(ROPE))
    )
    reference = reference.eval()
    with torch.no_grad():  # norms away from one, so a norm read from the wrong tensor shows
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape) * 0.1)
    directory = tmp_path_factory.mktemp("large3") / "Mistral-Large-3-tiny"
    directory.mkdir()
    (directory / "params.json").write_text(json.dumps(params_json()))
    save_file(native_tensors(reference.state_dict()), str(directory / "consolidated.safetensors"))
    build_tiny_tokenizer(directory)
    return directory, reference


def test_mistral_large3_loads_as_deepseek_v3_and_matches_transformers(large3):
    directory, reference = large3
    checkpoint = resolve(str(directory))
    assert checkpoint.weight_format == "mistral"
    loaded = load_model(checkpoint, "f32")
    cfg = loaded.cfg
    assert cfg.family == "deepseek_v3" and cfg.mla is not None and cfg.moe.scoring == "softmax"
    assert cfg.moe.renormalize and not cfg.moe.correction_bias
    assert (cfg.query_temperature_beta, cfg.query_temperature_length) == (
        ROPE["llama_4_scaling_beta"],
        ORIGINAL,
    )
    ids = torch.randint(3, 300, (2, 3 * ORIGINAL + 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model(ids)
        theirs = reference(ids).logits
    result = compare(ours, theirs)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, result
    prompt = ids[:1, : ORIGINAL - 3]  # decoding crosses the first temperature step from the cache
    with torch.no_grad():
        want = reference.generate(prompt, max_new_tokens=8, do_sample=False)[
            0, prompt.shape[1] :
        ].tolist()
    got = engine_tokens(loaded, [prompt[0].tolist()], 8, cfg.eos_token_ids)[0]
    assert got == want


def test_the_token_engine_answers_as_transformers_does(large3):
    """`ster generate` (the paged token engine) past the temperature's first step, against
    Transformers."""
    directory, reference = large3
    prompt = "The quick brown fox jumps over the lazy dog. Hello world! This is a tiny tokenizer"
    ids = Tokenizer.from_directory(directory).encode(prompt)
    assert len(ids) > ORIGINAL
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[
            0, len(ids) :
        ].tolist()
    got = cli_generate(
        f"--model={directory}", f"--prompt={prompt}", "--chat-template=off", "--max-new-tokens=8"
    )
    assert got["prompt_tokens"] == len(ids) and got["completion_tokens"] == len(want)
    assert got["text"] == Tokenizer.from_directory(directory).decode(want)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"llama_4_scaling": {"beta": 0.1}},
            "llama_4_scaling must state beta and original_max_position_embeddings",
        ),
        (
            {"llama_4_scaling": {"beta": 0.1, "original_max_position_embeddings": 32}},
            "llama_4_scaling counts positions in 32, the yarn block in 16",
        ),
        (
            {
                "moe": {
                    "num_experts": 6,
                    "num_experts_per_tok": 2,
                    "num_shared_experts": 1,
                    "num_expert_groups": 2,
                }
            },
            "moe routes within expert groups",
        ),
        (
            {
                "moe": {
                    "num_experts": 6,
                    "num_experts_per_tok": 2,
                    "num_shared_experts": 1,
                    "capacity": 3,
                }
            },
            "moe sets capacity, which ster_dist does not read",
        ),
    ],
)
def test_what_mistral_large3_cannot_state_is_refused_before_any_weight(tmp_path, change, message):
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "params.json").write_text(json.dumps({**params_json(), **change}))
    (directory / "consolidated.safetensors").write_bytes(b"never read")
    build_tiny_tokenizer(directory)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(directory)))
    assert message in str(refused.value) and "\n" not in str(refused.value)
