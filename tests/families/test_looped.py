"""Looped models' own checks (ster_dist/model/loop.py, families/looped.py): HRM-Text (hrm_text)
under prefix_lm, against Transformers' HrmTextForCausalLM given the prompt as token_type_ids of
ones. A prompt read whole from position zero attends both ways within itself, in the static cache
and in the token engine (which reads each prompt in one chunk and shares no prefix), later tokens
and reads without a cache causally; every pass is its own layer (cache slots, hook site) over
weights held once. HRM-Text's causal parity, cache, batch and TP=2 checks run in
tests/families/test_parity.py and tests/parallel/test_tensor_parallel.py (tests/tiny/looped.py).

IQuest-LoopCoder (iquestloopcoder), which Transformers lacks, against a plain-torch reference
written here from the seed's text: logits and greedy tokens, the cache equal to the whole read,
batches equal to one at a time, the token engine equal to the static cache, and TP=2 equal to one
rank."""

from __future__ import annotations

import json

import pytest
import torch

from ster_dist.engine.blocks import BlockPool
from ster_dist.engine.sampling import SamplingParams
from ster_dist.engine.scheduler import Scheduler, Sequence
from ster_dist.errors import Refusal
from ster_dist.families.registry import family_table
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import alone, engine_tokens
from tests.remote_checks import (
    check_cache_and_batches,
    check_group_equals_one_rank,
    greedy_by_rereading,
    random_ids,
)
from tests.engine.test_recurrent_engine import open_engine, prompts, run_all
from tests.tiny_models import BASE_CONFIG, perturb_norms
from tests.tiny_tokenizer import build_tiny_tokenizer

# two layers a stack, two high cycles of three low passes and one high: 16 passes' layers
HRM = dict(
    num_hidden_layers=2, head_dim=16, H_cycles=2, L_cycles=3, embedding_scale=7.0, prefix_lm=True
)


@pytest.fixture(scope="module")
def hrm(tmp_path_factory):
    """(checkpoint directory, Transformers' model, ours loaded) of a tiny HRM-Text under
    prefix_lm."""
    import transformers

    directory = tmp_path_factory.mktemp("hrm_text")
    torch.manual_seed(0)
    reference = transformers.HrmTextForCausalLM(
        transformers.HrmTextConfig(**{**BASE_CONFIG, **HRM})
    ).eval()
    perturb_norms(reference, 0)  # z_L_init starts at zero
    reference.save_pretrained(directory, safe_serialization=True)
    build_tiny_tokenizer(directory)
    return directory, reference, load_model(resolve(str(directory)), "f32")


def _typed(length: int, prompt: int) -> torch.Tensor:
    return (torch.arange(length) < prompt).long().unsqueeze(0)


def test_a_prompt_read_whole_attends_both_ways_then_each_token_causally(hrm):
    _, reference, loaded = hrm
    ids = random_ids(2, 20, seed=2)
    with torch.no_grad():
        cache = loaded.model.new_cache(2, 20)
        parts = [loaded.model(ids[:, :12], cache=cache)]
        parts += [loaded.model(ids[:, t : t + 1], cache=cache) for t in range(12, 20)]
        theirs = reference(ids, token_type_ids=_typed(20, 12).expand(2, -1)).logits
        causal = reference(ids).logits
    stepped = torch.cat(parts, dim=1)
    result = compare(stepped, theirs)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, result
    # the prompt's two-way reading shows
    assert compare(stepped, causal)["max_relative_error"] > 1e-2


def test_a_read_without_a_cache_scores_every_position_causally(hrm):
    _, reference, loaded = hrm
    ids = random_ids(2, 20, seed=3)
    with torch.no_grad():
        result = compare(loaded.model(ids), reference(ids).logits)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, result


def test_greedy_generation_equals_transformers_given_the_prompt_as_token_type_ids(hrm):
    _, reference, loaded = hrm
    prompt = random_ids(1, 7, seed=1)
    with torch.no_grad():
        theirs = reference.generate(
            prompt, token_type_ids=torch.ones_like(prompt), max_new_tokens=12, do_sample=False
        )[0, 7:].tolist()
    assert engine_tokens(loaded, [prompt[0].tolist()], 12)[0] == theirs


def test_prompts_batched_in_the_engine_equal_each_alone(hrm):
    _, _, loaded = hrm
    ps = [random_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 9, 6)]
    assert engine_tokens(loaded, ps, 5) == [engine_tokens(loaded, [p], 5)[0] for p in ps]


def test_the_engine_reads_each_prompt_whole_and_equals_whole_reads(hrm):
    directory, _, loaded = hrm
    ps = prompts(4, seed=1, lo=3, hi=14)
    lengths = [9, 4, 8, 6]
    # sixteen tokens a step and few blocks: a prompt waits for a step with room for all of it,
    # beside other
    # requests' decodes
    with open_engine(directory, max_step_tokens=16, max_blocks=20) as engine:
        got = run_all(engine, ps, lengths)
        again = engine.submit(ps[0], SamplingParams(max_tokens=5, ignore_eos=True)).result()
        stats = engine.stats()
        with pytest.raises(Refusal, match="attends both ways") as refused:
            engine.submit(list(range(3, 20)), SamplingParams(max_tokens=2))
        assert "\n" not in str(refused.value)
    for p, n, tokens in zip(ps, lengths, got):
        assert tokens == alone(loaded.model, p, n)
    assert stats["prefix_caching"] is False and again.cached_tokens == 0
    assert stats["steps"] < sum(lengths)  # requests shared steps


def test_a_prompt_longer_than_a_chunk_is_refused_by_the_scheduler():
    scheduler = Scheduler(
        BlockPool(64, 4, prefix_caching=False), max_step_tokens=8, whole_prompt=True
    )
    with pytest.raises(ValueError, match="read whole, in one chunk"):
        scheduler.add(Sequence("long", list(range(3, 12)), 9, 4))
    with pytest.raises(ValueError, match="cannot share prefixes"):
        Scheduler(BlockPool(64, 4), whole_prompt=True)


def test_every_pass_is_a_layer_of_its_own_over_weights_held_once(hrm):
    _, reference, loaded = hrm
    model, cfg = loaded.model, loaded.cfg
    assert (cfg.num_layers, cfg.loop_layers, len(cfg.loop_schedule)) == (16, 2, 8)
    assert [stack for stack, _, _ in cfg.loop_schedule] == [0, 0, 0, 1] * 2
    assert len(model.new_cache(1, 4).keys) == 16  # every pass its own key-value slots
    held = sum(p.numel() for p in model.parameters())  # tied parameters are listed once
    assert held == sum(p.numel() for p in reference.parameters())
    assert all(
        name.startswith(("stacks.", "loop_init", "embed", "lm_head", "final_norm"))
        for name, _ in model.named_parameters()
    )
    seen = []
    remove = model.add_hook(15, lambda h: seen.append(h.shape))
    with torch.no_grad():
        model(random_ids(1, 5))
    remove()
    assert seen == [torch.Size([1, 5, BASE_CONFIG["hidden_size"]])]


def test_hrm_text_is_listed_parity_checked_against_transformers():
    row = {row["family"]: row for row in family_table()}["hrm_text"]
    assert row["status"] == "parity-checked" and row["reference"] == "HrmTextForCausalLM"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"H_cycles": 0}, "H_cycles is 0"),
        ({"L_cycles": "three"}, "L_cycles is 'three'"),
        ({"num_layers_per_stack": -1}, "num_layers_per_stack is -1"),
    ],
)
def test_what_hrm_text_cannot_state_is_refused_before_any_weight(hrm, tmp_path, change, message):
    config = {**json.loads((hrm[0] / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    build_tiny_tokenizer(tmp_path)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(tmp_path)))
    assert message in str(refused.value) and "\n" not in str(refused.value)


# -- iquestloopcoder: Transformers lacks it; the reference below is written from the seed's text
# ----------------

LOOP = dict(
    vocab_size=BASE_CONFIG["vocab_size"],
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    loop_num=3,
    loop_window_size=5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _loopcoder_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, hidden = LOOP["head_dim"], LOOP["hidden_size"]
    heads, kv = LOOP["num_attention_heads"], LOOP["num_key_value_heads"]

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    t = {
        "model.embed_tokens.weight": rand(LOOP["vocab_size"], hidden, scale=1.0),
        "lm_head.weight": rand(LOOP["vocab_size"], hidden),
        "model.norm.weight": 1 + rand(hidden),
    }
    for i in range(LOOP["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + rand(hidden),
            p + "post_attention_layernorm.weight": 1 + rand(hidden),
            p + "self_attn.q_proj.weight": rand(heads * d, hidden),
            p + "self_attn.k_proj.weight": rand(kv * d, hidden),
            p + "self_attn.v_proj.weight": rand(kv * d, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * d),
            p + "mlp.gate_proj.weight": rand(LOOP["intermediate_size"], hidden),
            p + "mlp.up_proj.weight": rand(LOOP["intermediate_size"], hidden),
            p + "mlp.down_proj.weight": rand(hidden, LOOP["intermediate_size"]),
            f"model.gate_projections.{i}.weight": rand(heads, d, scale=0.5),
            f"model.gate_projections.{i}.bias": rand(heads, scale=0.5),
        }
    return t


def _rms(x, w, eps=LOOP["rms_norm_eps"]):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _attend(q, k, v, window=None):
    """Causal softmax attention [b, h, t, d] (keys repeated to every query head), within `window`
    positions."""
    t = q.shape[2]
    distance = torch.arange(t).view(-1, 1) - torch.arange(t).view(1, -1)
    allowed = (distance >= 0) & (distance < window if window else True)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def loopcoder_reference(t: dict, ids: torch.Tensor) -> torch.Tensor:
    """IQuest-LoopCoder from the seed: Llama's block over the stored layers loop_num times, no norm
    between passes; on later passes g * global (the first pass's keys and values of the layer) + (1
    - g) * local (the pass's own within loop_window_size), g = sigmoid(w_h . q_h + b_h) of the
    rotated query."""
    b, n = ids.shape
    d, heads, kv = LOOP["head_dim"], LOOP["num_attention_heads"], LOOP["num_key_value_heads"]
    inv = 1.0 / (LOOP["rope_parameters"]["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rotate(x):
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    h, first = t["model.embed_tokens.weight"][ids], {}
    for loop in range(LOOP["loop_num"]):
        for i in range(LOOP["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = _rms(h, t[p + "input_layernorm.weight"])
            q = rotate(
                (x @ t[p + "self_attn.q_proj.weight"].T).view(b, n, heads, d).transpose(1, 2)
            )
            k = rotate((x @ t[p + "self_attn.k_proj.weight"].T).view(b, n, kv, d).transpose(1, 2))
            v = (x @ t[p + "self_attn.v_proj.weight"].T).view(b, n, kv, d).transpose(1, 2)
            k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
            if loop == 0:
                first[i] = k, v
                out = _attend(q, k, v)
            else:
                gate = torch.sigmoid(
                    torch.einsum("bhtd,hd->bht", q, t[f"model.gate_projections.{i}.weight"])
                    + t[f"model.gate_projections.{i}.bias"][None, :, None]
                )[..., None]
                out = gate * _attend(q, *first[i]) + (1 - gate) * _attend(
                    q, k, v, LOOP["loop_window_size"]
                )
            h = h + out.transpose(1, 2).reshape(b, n, -1) @ t[p + "self_attn.o_proj.weight"].T
            x = _rms(h, t[p + "post_attention_layernorm.weight"])
            gated = torch.nn.functional.silu(x @ t[p + "mlp.gate_proj.weight"].T) * (
                x @ t[p + "mlp.up_proj.weight"].T
            )
            h = h + gated @ t[p + "mlp.down_proj.weight"].T
    return _rms(h, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.fixture(scope="module")
def loopcoder(tmp_path_factory):
    """(checkpoint directory, its tensors, ours loaded) of a tiny IQuest-LoopCoder: three passes
    over two layers, a local window shorter than the prompts."""
    from safetensors.torch import save_file

    directory = tmp_path_factory.mktemp("iquestloopcoder")
    tensors = _loopcoder_tensors()
    config = {
        "model_type": "iquestloopcoder",
        "architectures": ["IQuestLoopCoderForCausalLM"],
        "hidden_act": "silu",
        **LOOP,
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    build_tiny_tokenizer(directory)
    return directory, tensors, load_model(resolve(str(directory)), "f32")


def test_iquestloopcoder_logits_and_greedy_tokens_match_the_reference(loopcoder):
    _, tensors, loaded = loopcoder
    ids = random_ids(2, 24, seed=5)
    with torch.no_grad():
        result = compare(loaded.model(ids), loopcoder_reference(tensors, ids))
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, result
    prompt = random_ids(1, 7, seed=6)[0].tolist()
    ours = engine_tokens(loaded, [prompt], 8)[0]
    assert ours == greedy_by_rereading(lambda x: loopcoder_reference(tensors, x), prompt, 8, eos=-1)


def test_iquestloopcoder_decodes_from_the_cache_as_it_reads_whole_and_batches_as_alone(loopcoder):
    check_cache_and_batches(loopcoder[2], "iquestloopcoder")


def test_iquestloopcoder_in_the_engine_equals_whole_reads(loopcoder):
    directory, _, loaded = loopcoder
    ps = prompts(5, seed=3, lo=3, hi=20)
    lengths = [9, 4, 12, 1, 7]
    # long prompts read in chunks beside decodes
    with open_engine(directory, max_step_tokens=8) as engine:
        got = run_all(engine, ps, lengths)
    for p, n, tokens in zip(ps, lengths, got):
        assert tokens == alone(loaded.model, p, n)


def test_iquestloopcoder_on_two_tensor_parallel_ranks_equals_one(tp2, loopcoder):
    check_group_equals_one_rank(tp2, {"iquestloopcoder": (loopcoder[0], loopcoder[2])})


def test_iquestloopcoder_runs_every_pass_as_layers_of_its_own(loopcoder):
    cfg, model = loopcoder[2].cfg, loopcoder[2].model
    assert (cfg.num_layers, cfg.loop_layers) == (6, 2)
    assert cfg.layer_window == (None, None, 5, 5, 5, 5)
    assert len(model.new_cache(1, 4).keys) == 6
    assert sum(p.numel() for p in model.parameters()) == sum(
        t.numel() for t in loopcoder[1].values()
    )
    row = {row["family"]: row for row in family_table()}["iquestloopcoder"]
    assert row["status"] == "parity-checked" and row["reference"] == "tests/families/test_looped.py"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"loop_num": 0}, "loop_num is 0"),
        ({"loop_window_size": 0}, "loop_window_size is 0"),
    ],
)
def test_what_iquestloopcoder_cannot_state_is_refused_before_any_weight(
    loopcoder, tmp_path, change, message
):
    config = {**json.loads((loopcoder[0] / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    build_tiny_tokenizer(tmp_path)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(tmp_path)))
    assert message in str(refused.value) and "\n" not in str(refused.value)
