"""Compiled layers (model/compiled.py) against the eager ones they replace: the same logits within
f32 rounding, the same greedy tokens, one graph shared by every layer, attention and the cache left
to the live step (static and paged), hooks and routed adapters running eagerly, a model that cannot
compile staying eager, mixture-of-experts models with their experts inside the graph, and TP=2
through the collectives inside the graph.

Compiling costs seconds on these 2 cores, so each model here is compiled once per module; the rest
of the suite runs eager (tests/conftest.py sets STER_ENFORCE_EAGER) and these tests lift that
setting."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from ster_dist import kernels
from ster_dist.engine.loop import COMPILE_AFTER
from ster_dist.engine.runner import pack_model
from ster_dist.engine.sampling import SamplingParams
from ster_dist.model.cache import left_pad
from ster_dist.load import load_model
from ster_dist.model.compiled import decode_plans
from ster_dist.model.paged_step import PagedStep
from ster_dist.model.step import StepState
from ster_dist.parallel import packed
from ster_dist.resolve import resolve
from ster_dist.load.toy import make_toy_model
from ster_dist.workers.spawn import SpawnGroup
from tests.native_kernels import built
from tests.engine.test_engine import group_cfg, open_engine, prompts

NEW = 6


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("compiled") / "llama"
    make_toy_model(directory, layers=3, hidden=64, seed=3)
    return directory


@pytest.fixture(scope="module")
def compiling():
    saved = os.environ.pop("STER_ENFORCE_EAGER", None)
    yield
    if saved is not None:
        os.environ["STER_ENFORCE_EAGER"] = saved


@pytest.fixture(scope="module")
def models(toy, compiling):
    """The same checkpoint twice: one model eager, one compiled."""
    eager = load_model(resolve(str(toy))).model
    compiled = load_model(resolve(str(toy))).model
    assert compiled.compile_layers() is None
    return eager, compiled


def decode(model, prompt: torch.Tensor, new: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits of the prompt's last position and of each greedy decode step [steps, batch, vocab],
    and the tokens."""
    batch, width = prompt.shape
    positions, valid = (
        torch.arange(width).expand(batch, width),
        torch.ones_like(prompt, dtype=torch.bool),
    )
    return decode_from(model, prompt, positions, valid, new)


@torch.inference_mode()
def decode_from(model, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, new: int):
    """decode() of prompts given as ids, positions and valid [batch, width] (left padding, as
    model/cache.left_pad pads)."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + new)
    logits = [model(ids, positions, valid, cache)[:, -1]]
    tokens, nxt = [], positions[:, -1:] + 1
    for _ in range(new - 1):
        tok = logits[-1].argmax(-1)
        tokens.append(tok.tolist())
        logits.append(
            model(tok.unsqueeze(1), nxt, torch.ones_like(nxt, dtype=torch.bool), cache)[:, -1]
        )
        nxt = nxt + 1
    return torch.stack(logits), tokens


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    rel = ((a - b).norm() / b.norm()).item()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    assert rel < 1e-5 and cos > 1 - 1e-6, (rel, cos)


def test_compiled_layers_give_the_eager_logits_and_share_one_graph(models):
    eager, compiled = models
    prompt = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    want, want_tokens = decode(eager, prompt, NEW)
    got, got_tokens = decode(compiled, prompt, NEW)
    close(got, want)
    assert got_tokens == want_tokens
    # three layers of one structure, a 9-token prefill and 1-token decodes: a graph per token count,
    # not per layer
    assert 1 <= compiled.compiled.graphs <= 2 < compiled.cfg.num_layers * 2


def _stacked_as_eager(directory, capfd, seed: int):
    """A compiled model of `directory` whose one-token steps ran as one stacked graph and gave the
    eager model's logits and greedy tokens for a 7-token prompt; returns it and the prompt."""
    eager = load_model(resolve(str(directory))).model
    compiled = load_model(resolve(str(directory))).model
    assert compiled.compile_layers() is None
    prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(seed))
    want, want_tokens = decode(eager, prompt, NEW)
    got, got_tokens = decode(compiled, prompt, NEW)
    close(got, want)
    assert got_tokens == want_tokens
    said = capfd.readouterr().err
    assert "one-token stack graph" in said and "stack failed" not in said
    assert compiled.compiled.stacked
    return compiled, prompt


def test_one_token_steps_run_the_whole_stack_in_one_graph(toy, compiling, capfd, monkeypatch):
    # the toy's plain layers would step natively (test_native_stack.py)
    monkeypatch.setenv("STER_NATIVE_STACK", "0")
    compiled, prompt = _stacked_as_eager(toy, capfd, seed=1)
    graphs = compiled.compiled.graphs
    decode(compiled, prompt, 3)
    assert compiled.compiled.graphs == graphs  # the second run compiled nothing more


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_one_token_steps_stack_over_weights_packed_in_panels(
    toy, compiling, capfd, precision, monkeypatch
):
    """The products of a packed model ask kernels.panels(dtype) inside the graph: the one-token
    stack, which reuses one layer's region for the next, must still build (a guard on a dtype-keyed
    table once broke it in bf16)."""
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[precision]
    if not kernels.panels(dtype):
        pytest.skip(f"this CPU's kernels lay out no {precision} panels")
    monkeypatch.setenv("STER_NATIVE_STACK", "0")  # f32 would step natively (test_native_stack.py)
    model = load_model(resolve(str(toy)), precision=precision).model
    weights = pack_model(model, "on")
    try:
        assert weights and all(packed.lookup(w).panels for w in weights)
        assert model.compile_layers() is None
        prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(2))
        decode(model, prompt, 4)
        said = capfd.readouterr().err
        # the stack, the head, the layers
        assert "one-token stack graph" in said and "failed" not in said, said
        assert model.compiled.stacked
    finally:
        packed.release(weights)


def _counting(monkeypatch, cls) -> list[int]:
    """The layers whose attention reaches `cls.attend` (Python) from now on, in call order."""
    calls: list[int] = []
    original = cls.attend

    def attend(self, layer, *args, **kwargs):
        calls.append(layer)
        return original(self, layer, *args, **kwargs)

    monkeypatch.setattr(cls, "attend", attend)
    return calls


def _decodes_planned_as_eager(eager, compiled, prompt: torch.Tensor, monkeypatch) -> None:
    """The compiled model decodes `prompt` with the eager logits and tokens, and only its prefill's
    layers call back into Python for attention."""
    want, want_tokens = decode(eager, prompt, NEW)
    calls = _counting(monkeypatch, StepState)
    got, got_tokens = decode(compiled, prompt, NEW)
    close(got, want)
    assert got_tokens == want_tokens
    assert calls == list(range(compiled.cfg.num_layers))  # the prefill's layers, then none


def test_planned_decode_steps_attend_in_the_kernel_and_give_the_eager_logits(models, monkeypatch):
    """A decode step states its cache to the kernels once (push_plan) and no layer's attention calls
    back into Python; the prefill, which is not planned, does."""
    eager, compiled = models
    prompt = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    _decodes_planned_as_eager(eager, compiled, prompt, monkeypatch)


def test_a_decode_step_over_real_keys_builds_no_mask(models, monkeypatch):
    """Issue 18's fifth item: a step of one token a row over keys that are all real reads no mask,
    so it builds none (StepState._base: the causal pairs and the diagonal every mask starts from); a
    step over a left-padded row's keys still does, and masks the padding."""
    _, compiled = models
    steps: list[StepState] = []
    original = StepState.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        steps.append(self)

    monkeypatch.setattr(StepState, "__init__", init)
    decode(compiled, torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(4)), NEW)
    assert len(steps) == NEW and not any("_base" in vars(step) for step in steps[1:])
    steps.clear()
    decode_from(compiled, *left_pad([[5, 9, 13, 17, 21, 25], [7, 11, 15]]), NEW)
    assert len(steps) == NEW and all("_base" in vars(step) for step in steps[1:])


def test_a_layer_left_out_of_the_plan_attends_through_python(models, monkeypatch):
    eager, compiled = models
    prompt = torch.randint(3, 300, (1, 6), generator=torch.Generator().manual_seed(6))
    want, _ = decode(eager, prompt, NEW)
    scales = decode_plans(compiled)
    assert all(s > 0 for s in scales)
    monkeypatch.setattr(compiled.compiled, "scales", [scales[0]] + [0.0] * (len(scales) - 1))
    calls = _counting(monkeypatch, StepState)
    got, _ = decode(compiled, prompt, NEW)
    close(got, want)
    layers = list(range(compiled.cfg.num_layers))
    assert calls == layers + layers[1:] * (NEW - 1)


@pytest.mark.slow  # a compile, about 20 s
def test_a_windowed_mixture_of_experts_model_attends_in_the_kernel_within_its_window(
    tmp_path, compiling, monkeypatch
):
    """Mixtral's sliding window (6, below the 9-token prompt plus its decodes): its planned decode
    steps keep to each row's last keys in the kernel, never calling back into Python, and give the
    eager logits."""
    from tests.tiny_models import make_tiny

    make_tiny("mixtral", tmp_path / "mixtral")
    eager = load_model(resolve(str(tmp_path / "mixtral"))).model
    compiled = load_model(resolve(str(tmp_path / "mixtral"))).model
    # experts: no native step
    assert compiled.compile_layers() is None and compiled.compiled.native is None
    assert {block.token_mixer.window for block in compiled.layers} == {6}
    prompt = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(7))
    _decodes_planned_as_eager(eager, compiled, prompt, monkeypatch)


def test_a_hook_runs_eagerly_and_steers_as_it_does_eagerly(models):
    eager, compiled = models
    prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(1))
    shift = torch.randn(eager.cfg.hidden_size, generator=torch.Generator().manual_seed(2))

    def steer(h):
        return h + shift

    removers = [m.add_hook(1, steer) for m in (eager, compiled)]
    try:
        want, _ = decode(eager, prompt, 3)
        got, _ = decode(compiled, prompt, 3)
    finally:
        for remove in removers:
            remove()
    close(got, want)
    plain, _ = decode(eager, prompt, 3)
    assert not torch.allclose(plain, want)  # the hook did change the logits


def _eager_and_compiled_answers(
    directory, batch: list[list[int]], tokens: int, compile_after: int, ranks=None
):
    """The token ids a paged engine answers `batch` with (submitted together), eager and compiled
    after
    `compile_after` steps; `ranks`: makes the engine's group of ranks (None: one local rank)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    answers = []
    for config in ({}, {"compile_after": compile_after}):
        with contextlib.ExitStack() as stack:
            group = stack.enter_context(ranks()) if ranks is not None else None
            engine = stack.enter_context(open_engine(directory, group=group, **config))
            answers.append(
                [s.result().token_ids for s in [engine.submit(p, params) for p in batch]]
            )
    return answers


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """A tiny Gemma 4 E model: each layer's own input added through its gate, and its last two
    layers reading the keys and values of the last earlier layer of their kind."""
    from tests.tiny_models import make_tiny

    directory = tmp_path_factory.mktemp("compiled") / "gemma4_text"
    make_tiny("gemma4_text", directory)
    return directory


@pytest.mark.slow  # 20-80 s on 2 cores (issue 57: the default suite's budget)
def test_per_layer_inputs_and_shared_keys_compile_and_give_the_eager_logits(
    gemma4, compiling, capfd
):
    """Gemma 4's E models compile: each layer's graph takes the layer's own input beside h, and a
    shared layer's attention is one `attend_shared` operator over what its source layer kept in the
    live step. A prompt and the one-token stack give the eager logits and tokens, without a graph
    break (steps of several rows: below)."""
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    compiled, _ = _stacked_as_eager(gemma4, capfd, seed=2)
    shared = [b.token_mixer for b in compiled.layers if b.token_mixer.kv_source is not None]
    assert shared and compiled.per_layer_inputs is not None  # what this test is about
    assert (
        compiled.compiled is not None and "compiling the step failed" not in capfd.readouterr().err
    )
    assert sum(counters["graph_break"].values()) == breaks


# about 50 s of compiling in CI; the Gemma 4 E tests above compile per-layer inputs and shared keys
@pytest.mark.slow
def test_altup_copies_compile_and_give_the_eager_logits(tmp_path, compiling, capfd):
    """Gemma 3n compiles: its graphs run over AltUp's copies of the stream [copies, batch, tokens,
    width] (the decoder makes them before the layers and collapses them after), each layer given its
    own input, its last layers reading earlier layers' keys. A prompt and the one-token stack give
    the eager logits and tokens."""
    from tests.tiny_models import make_tiny

    make_tiny("gemma3n_text", tmp_path / "gemma3n")
    compiled, _ = _stacked_as_eager(tmp_path / "gemma3n", capfd, seed=5)
    assert compiled.altup is not None and any(
        b.token_mixer.kv_source is not None for b in compiled.layers
    )
    assert compiled.compiled is not None  # no step fell back to the eager layers


@pytest.mark.slow  # 20-80 s on 2 cores (issue 57: the default suite's budget)
def test_the_paged_engine_compiles_a_gemma4_e_model_and_answers_as_the_eager_one(
    gemma4, compiling, capfd
):
    want, got = _eager_and_compiled_answers(
        gemma4, prompts(4, seed=6, lo=2, hi=10), 6, compile_after=1
    )
    assert got == want
    said = capfd.readouterr().err
    assert (
        "compiling the layers after" in said and "stay eager" not in said and "failed" not in said
    )


def test_the_paged_engine_compiled_after_its_first_steps_answers_as_the_eager_one(
    toy, compiling, capfd, monkeypatch
):
    # else its decodes step natively and compile nothing
    monkeypatch.setenv("STER_NATIVE_STACK", "0")
    want, got = _eager_and_compiled_answers(
        toy, prompts(5, seed=4, lo=2, hi=14), 8, compile_after=2
    )
    assert got == want
    assert "compiled 1 step graph" in capfd.readouterr().err


def test_the_paged_engines_decode_steps_are_planned(toy, compiling, monkeypatch):
    # after the test above: graphs are shared by the process, and that one asserts it compiles its
    # own
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = prompts(1, seed=7, lo=5, hi=6)[0]
    with open_engine(toy) as engine:
        want = engine.submit(prompt, params).result().token_ids
    calls = _counting(monkeypatch, PagedStep)
    with open_engine(toy, compile_after=1) as engine:
        got = engine.submit(prompt, params).result().token_ids
    assert got == want
    # the eager prefill; the compiled decodes never call back
    assert calls == list(range(group_cfg(resolve(str(toy))).num_layers))


def test_a_warmed_engine_meets_no_compile_at_any_step_size(toy, compiling, capfd):
    # after the two tests above, which assert that they compile graphs of their own
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    batch = [list(range(3, 3 + n)) for n in (1, 2, 5, 8, 9, 12, 15, 16, 17, 31, 40)]
    with open_engine(toy, max_step_tokens=32) as engine:  # never compiles
        want = [engine.submit(p, params).result().token_ids for p in batch]
        engine.warm_up()
    assert "warmed" not in capfd.readouterr().err
    with open_engine(toy, max_step_tokens=32, compile_after=COMPILE_AFTER) as engine:
        engine.warm_up()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        # each prompt's sizes by itself
        alone = [engine.submit(p, params).result().token_ids for p in batch]
        # mixed steps
        together = [s.result().token_ids for s in [engine.submit(p, params) for p in batch]]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert alone == want and together == want
    assert "warmed the compiled steps for 1 to 32 tokens" in capfd.readouterr().err


def test_a_model_that_cannot_compile_says_why_and_runs_eagerly(tmp_path, compiling, capfd):
    directory = tmp_path / "mla"
    make_toy_model(directory, family="deepseek_v3", layers=2, hidden=64, seed=0)
    model = load_model(resolve(str(directory))).model
    reason = model.compile_layers()
    assert reason is not None and "LatentAttention" in reason
    assert model.compiled is None
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with open_engine(directory, compile_after=1) as engine:
        assert len(engine.submit([5, 6, 7], params).result().token_ids) == 4
    assert "steps stay eager: layer 0 is LatentAttention" in capfd.readouterr().err


def test_enforce_eager_is_an_engine_option_of_generate_chat_and_serve():
    from ster_dist.cli import parse

    for command in ("generate", "chat", "serve"):
        extra = ["--prompt=hi"] if command == "generate" else []
        eager = parse([command, "--model=m", "--enforce-eager", *extra])
        default = parse([command, "--model=m", *extra])
        assert eager.engine_options()[3] is True and default.engine_options()[3] is False


# two ranks compiling at once: about a minute here; the one-rank tests above compile the same layers
@pytest.mark.slow
@pytest.mark.parametrize("which", ["toy", "moe", "gemma4"])
def test_tp2_compiled_layers_give_the_eager_logits(which, request, compiling):
    """The row-parallel all-reduce runs inside each rank's graph (a functional collective over
    gloo); a MoE layer's too, once for its experts' and shared expert's partial sums; a Gemma 4 E
    layer's once more, for its gate's."""
    checkpoint = resolve(str(request.getfixturevalue(which)))
    prompt = torch.tensor([[5, 9, 30, 7, 2, 11]])
    with SpawnGroup(2) as group:
        group.call("load", checkpoint, "f32", "cpu")
        want = group.call("logits", prompt)
        assert group.call("compile_layers") == [None, None]
        got = group.call("logits", prompt)
        again = group.call("logits", prompt)
    close(got[0], want[0])
    assert torch.equal(got[0], again[0])  # the second call ran the graphs the first one compiled


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen2-MoE: routed experts (top-2) beside a shared expert behind its sigmoid gate."""
    from tests.tiny_models import make_tiny

    directory = tmp_path_factory.mktemp("compiled") / "qwen2_moe"
    make_tiny("qwen2_moe", directory)
    return directory


@pytest.mark.slow  # 20-80 s on 2 cores (issue 57: the default suite's budget)
def test_a_mixture_of_experts_model_compiles_with_its_experts_inside_the_graph(
    moe, compiling, capfd, monkeypatch
):
    """A step's routed experts trace as one operator whose output's shape does not depend on the
    routing: the experts kernel (kernels/experts.cpp), and past its 512 f32 rows (a prefill of 3 x
    100 tokens, top-2)
    `routed_experts`, which runs the eager branches inside. The one-token stack and steps of several
    rows give the eager logits and tokens, and no graph splits around the experts."""
    from torch._dynamo.utils import counters

    from ster_dist.moe.experts import Experts

    built("swiglu_experts", "the experts run eagerly and such models stay eager")
    eager = load_model(resolve(str(moe))).model
    compiled = load_model(resolve(str(moe))).model
    assert compiled.compile_layers() is None
    # its layers with routed experts
    sparse = sum(isinstance(m, Experts) for m in compiled.modules())
    routed = []
    original = Experts._routed
    monkeypatch.setattr(
        Experts, "_routed", lambda self, x, ids: routed.append(x.shape[0]) or original(self, x, ids)
    )
    breaks = sum(counters["graph_break"].values())
    for batch, width in ((1, 7), (3, 7), (3, 100)):
        prompt = torch.randint(
            3, 300, (batch, width), generator=torch.Generator().manual_seed(batch)
        )
        want, want_tokens = decode(eager, prompt, NEW)
        routed.clear()
        got, got_tokens = decode(compiled, prompt, NEW)
        close(got, want)
        assert got_tokens == want_tokens
        # the kernel took every other step
        assert routed == ([600] * sparse if width == 100 else [])
    assert sum(counters["graph_break"].values()) == breaks
    said = capfd.readouterr().err
    assert "one-token stack graph" in said and "stack failed" not in said
    assert compiled.compiled.stacked


def test_the_paged_engine_compiles_a_mixture_of_experts_model_and_answers_as_the_eager_one(
    moe, compiling, capfd
):
    built("swiglu_experts", "the experts run eagerly and such models stay eager")
    want, got = _eager_and_compiled_answers(
        moe, prompts(4, seed=5, lo=2, hi=10), 6, compile_after=1
    )
    assert got == want
    said = capfd.readouterr().err
    assert "compiling the layers after" in said and "stay eager" not in said


def test_experts_the_kernel_does_not_take_compile_behind_their_operator(
    tmp_path, compiling, capfd, monkeypatch
):
    """GPT-OSS's biased, clamped experts are not the kernel's: every step reaches them through
    `routed_experts`,
    the decodes of the one-token stack included, and gives the eager logits."""
    from tests.tiny_models import make_tiny

    from torch._dynamo.utils import counters

    from ster_dist.moe.experts import Experts

    make_tiny("gpt_oss", tmp_path / "gpt_oss")
    routed = []
    original = Experts._routed
    monkeypatch.setattr(
        Experts, "_routed", lambda self, x, ids: routed.append(x.shape[0]) or original(self, x, ids)
    )
    breaks = sum(counters["graph_break"].values())
    compiled, prompt = _stacked_as_eager(tmp_path / "gpt_oss", capfd, seed=4)
    experts = [m for m in compiled.modules() if isinstance(m, Experts)]
    assert experts and not any(e.kernel_takes() for e in experts)
    routed.clear()
    # the compiled model alone, its graphs whole: its experts ran inside the operator
    decode(compiled, prompt, 3)
    assert sum(counters["graph_break"].values()) == breaks
    # the prompt's rows (top-2), two decodes
    assert routed.count(7 * 2) == routed.count(1 * 2) // 2 == len(experts)


@pytest.mark.slow  # 20-80 s on 2 cores (issue 57: the default suite's budget)
def test_a_moe_layer_run_whole_behind_its_operator_gives_the_eager_logits(
    moe, compiling, monkeypatch
):
    """Expert-parallel layers (and identity experts) reach a compiled step as one `moe_layer`
    operator that runs the whole layer eagerly, collectives and all (moe/layer.py); here on one rank
    with every layer made such: the one-token stack and steps of several rows give the eager logits
    and tokens, through the operator, no graph split around it."""
    from torch._dynamo.utils import counters

    from ster_dist.moe.layer import MoE

    eager = load_model(resolve(str(moe))).model
    monkeypatch.setattr(MoE, "opaque", lambda self: True)
    whole = []
    original = MoE._forward
    monkeypatch.setattr(
        MoE,
        "_forward",
        lambda self, x, *rest: whole.append(x.shape[:-1]) or original(self, x, *rest),
    )
    compiled = load_model(resolve(str(moe))).model
    assert compiled.compile_layers() is None
    layers = sum(isinstance(m, MoE) for m in compiled.modules())
    breaks = sum(counters["graph_break"].values())
    # the graphs other tests traced through the experts kernel would pass their guards here (no
    # guard reads a
    # patched method), and these would pass theirs in the tests after
    torch._dynamo.reset()
    try:
        for batch in (1, 3):
            prompt = torch.randint(
                3, 300, (batch, 7), generator=torch.Generator().manual_seed(10 + batch)
            )
            want, want_tokens = decode(eager, prompt, 3)
            whole.clear()
            got, got_tokens = decode(compiled, prompt, 3)
            close(got, want)
            assert got_tokens == want_tokens
            # the prompt, then two decode steps
            assert whole == [(batch, 7)] * layers + [(batch, 1)] * 2 * layers
    finally:
        torch._dynamo.reset()
    assert sum(counters["graph_break"].values()) == breaks


@pytest.mark.slow  # two ranks compiling at once: about 40 s here
def test_ep2_compiled_layers_give_the_eager_logits(moe, compiling):
    """Over two expert-parallel ranks each compiled rank runs its MoE layers through `moe_layer`,
    the dispatch's all-to-alls and the gather of the ranks' token shares inside it. A one-token step
    leaves one rank's share empty: with the collectives in the graph, that rank's all-to-alls were
    cut from it (nothing read their output) and the other rank hung."""
    checkpoint = resolve(str(moe))
    prompts = [
        torch.tensor([[5, 9, 30, 7, 2, 11]]),
        torch.tensor([[5]]),
        torch.tensor([[5, 9, 30], [7, 2, 11]]),
    ]
    with SpawnGroup(2, ep=2, timeout_s=300) as group:
        group.call("load", checkpoint, "f32", "cpu")
        want = [group.call("logits", p)[0] for p in prompts]
        assert group.call("compile_layers") == [None, None]
        got = [group.call("logits", p)[0] for p in prompts]
        again = [group.call("logits", p)[0] for p in prompts]
    for w, g, a in zip(want, got, again):
        close(g, w)
        assert torch.equal(g, a)  # the second call ran the graphs the first one compiled


@pytest.mark.slow  # two engines of two ranks: about 20 s here
def test_the_paged_engine_over_ep2_ranks_compiled_answers_as_the_eager_one(moe, compiling, capfd):
    want, got = _eager_and_compiled_answers(
        moe,
        prompts(4, seed=5, lo=2, hi=10),
        6,
        compile_after=1,
        ranks=lambda: SpawnGroup(2, ep=2, timeout_s=300),
    )
    assert got == want
    said = capfd.readouterr().err
    assert "compiling the layers after 1 steps" in said and "stay eager" not in said


def test_the_operators_find_registered_layers_only_while_they_live(moe):
    """routed_experts and moe_layer find their modules by the experts' `up` stack in weak
    registries: a stack never registered (or replaced since) is refused in one line, and a model's
    entries go with the model."""
    import gc

    from ster_dist.moe import experts as experts_module, layer as layer_module
    from ster_dist.moe.layer import MoE, trace_moe

    model = load_model(resolve(str(moe))).model
    stack = next(m for m in model.modules() if isinstance(m, MoE)).experts.up
    x = torch.randn(2, stack.shape[-1])
    ids = torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="not registered for compiled steps"):
        torch.ops.ster_dist.routed_experts(x, ids, stack)
    trace_moe(model)
    keys = {m.experts.up.data_ptr() for m in model.modules() if isinstance(m, MoE)}
    assert keys <= set(layer_module._LAYERS) and keys <= set(experts_module._TRACED)
    layer = next(m for m in model.modules() if isinstance(m, MoE))
    whole = torch.ops.ster_dist.moe_layer(x.unsqueeze(0), None, stack)
    assert torch.equal(whole, layer._forward(x.unsqueeze(0), None, None))
    del model, stack, layer
    gc.collect()
    assert not keys & set(layer_module._LAYERS) and not keys & set(experts_module._TRACED)
