"""Decode steps of plain Llama- and Gemma-shaped layers as one native call (model/native_stack.py,
kernels/stack.cpp) against the compiled graph they replace and the eager layers: the graph's very
bits for every row, static and paged; the same logprobs for a request alone or among others,
whichever way each of its steps went; the graph again wherever a step or a model is not plain (a
layer out of the plan, an adapter attached, clipped queries, layer norms, sinks). In bf16 the
graph's bits are its rounding: where a loop stores, as inductor writes it for one row and for
several.

Each model here compiles its prefill graphs once (seconds on these 2 cores): the fast suite runs the
Llama toy (rotation by halves), GLM (interleaved pairs over part of each head, biased q, k and v),
Qwen3 (query and key heads normed), Granite (each sublayer's output scaled), Gemma 3 (norms over
offsets before and after each sublayer, heads normed, GELU, a sliding window and its own rotation on
alternate layers) and OLMo 2 (norms only after each sublayer, queries and keys normed over each
whole projection); the other plain families, Gemma 2's soft-capped attention among them, are
slow."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ster_dist import kernels
from ster_dist.adapters.attach import attach
from ster_dist.engine.loop import COMPILE_AFTER
from ster_dist.engine.runner import pack_model
from ster_dist.engine.sampling import SamplingParams
from ster_dist.model.cache import left_pad
from ster_dist.load import load_model
from ster_dist.model import native_stack
from ster_dist.model.native_stack import NativeStack, why_not
from ster_dist.parallel import packed
from ster_dist.resolve import resolve
from ster_dist.load.toy import make_toy_model
from tests.native_kernels import BUILDABLE
from tests.model.test_compiled_step import close, compiling, decode, decode_from  # noqa: F401  (compiling: a fixture)
from tests.engine.test_engine import open_engine, prompts, random_sites
from tests.tiny_models import SCORES_AT_THE_CAP, make_tiny, with_config

NEW = 6
# the static step; the paged engine's tests below step the Llama toy
FAST = [
    ("glm", "f32"),
    ("qwen3", "bf16"),
    ("granite", "f32"),
    ("gemma3_text", "bf16"),
    ("olmo2", "bf16"),
]
SLOW = [
    ("llama", "f32"),
    ("llama", "bf16"),
    ("glm", "bf16"),
    ("qwen3", "f32"),
    ("granite", "bf16"),
    ("exaone", "f32"),
    ("hyperclovax_no_post_norm", "f32"),
    ("llama_linear", "f32"),
    ("llama_yarn", "bf16"),
    ("ernie4_5", "bf16"),
    ("seed_oss", "f32"),
    ("iquestcoder", "bf16"),
    ("gemma3_text", "f32"),
    ("gemma", "f32"),
    ("gemma", "bf16"),
    ("glm4", "f32"),
    ("glm4", "bf16"),  # norms after the sublayers, not over offsets
    # sliding windows
    ("mistral", "f32"),
    ("mistral", "bf16"),
    ("phi3", "bf16"),
    ("qwen2", "f32"),
    ("smollm3", "f32"),
    ("smollm3", "bf16"),  # every fourth layer unrotated
    ("gemma2", "f32"),
    ("gemma2", "bf16"),
    ("vaultgemma", "bf16"),  # soft-capped attention
    # norms only after the sublayers, whole qk norms
    ("olmo2", "f32"),
    ("olmo3", "f32"),
    ("olmo3", "bf16"),
]
CAPPED = {"gemma2", "vaultgemma"}  # their scores brought to the cap (SCORES_AT_THE_CAP)

pytestmark = pytest.mark.skipif(
    not BUILDABLE, reason="no C++ compiler or no AVX2 here: steps run through the graph"
)


@pytest.fixture
def native_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of h each native step runs, in order, from now on."""
    calls: list[tuple[int, ...]] = []
    original = NativeStack.run

    def run(self, h, step):
        calls.append(tuple(h.shape))
        return original(self, h, step)

    monkeypatch.setattr(NativeStack, "run", run)
    return calls


def _compiled(directory, monkeypatch, native: bool = True, dtype: str = "f32"):
    """The checkpoint's model compiled, stepping natively or never."""
    model = load_model(resolve(str(directory)), precision=dtype).model
    with monkeypatch.context() as patched:
        if not native:
            patched.setenv("STER_NATIVE_STACK", "0")
        assert model.compile_layers() is None
    assert (model.compiled.native is not None) == native, model.compiled.native_why_not
    return model


def _same_bits_as_the_graph(variant, dtype, tmp_path, monkeypatch, native_calls) -> None:
    # graphs are kept per function for the whole process, and dynamo stops compiling a function
    # (runs it eagerly)
    # past 64 of them: two dozen families here would pass that
    torch._dynamo.reset()
    directory = tmp_path / variant
    make_tiny(variant, directory)
    if variant in CAPPED:
        directory = with_config(directory, tmp_path / f"{variant}_sharp", SCORES_AT_THE_CAP)
    eager = load_model(resolve(str(directory)), precision=dtype).model
    graph, native = (_compiled(directory, monkeypatch, way, dtype) for way in (False, True))
    for batch in (1, 3):
        prompt = torch.randint(3, 200, (batch, 7), generator=torch.Generator().manual_seed(batch))
        native_calls.clear()
        got, got_tokens = decode(native, prompt, NEW)
        # every decode step, no prefill
        assert native_calls == [(batch, 1, native.cfg.hidden_size)] * (NEW - 1)
        want, want_tokens = decode(graph, prompt, NEW)
        assert len(native_calls) == NEW - 1  # the graph model never stepped natively
        assert torch.equal(got, want) and got_tokens == want_tokens
        reference, reference_tokens = decode(eager, prompt, NEW)
        if dtype == "f32":
            close(got, reference)
            assert got_tokens == reference_tokens
        # the graph rounds bf16 where it stores, not after each operation as the eager layers do
        else:
            # each row compared while both fed it the same tokens: a near tie may pick another
            # (Gemma 2's logits are
            # capped at 3), and the row's later logits follow other tokens
            pairs = []
            for row in range(batch):
                mine, theirs = (
                    [tokens[row] for tokens in way] for way in (got_tokens, reference_tokens)
                )
                same = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), NEW - 1)
                pairs.append((got[: same + 1, row].float(), reference[: same + 1, row].float()))
            assert sum(len(mine) for mine, _ in pairs) >= batch * NEW / 2, (
                got_tokens,
                reference_tokens,
            )
            mine, theirs = (torch.cat(side) for side in zip(*pairs))
            rel = ((mine - theirs).norm() / theirs.norm()).item()
            assert rel < 2e-2, rel


@pytest.mark.parametrize("variant, dtype", FAST)
def test_native_decode_steps_give_the_graphs_bits(
    variant, dtype, tmp_path, compiling, monkeypatch, native_calls
):
    _same_bits_as_the_graph(variant, dtype, tmp_path, monkeypatch, native_calls)


@pytest.mark.slow  # a compile each, about 15 s
@pytest.mark.parametrize("variant, dtype", SLOW)
def test_every_plain_family_steps_natively_with_the_graphs_bits(
    variant, dtype, tmp_path, compiling, monkeypatch, native_calls
):
    _same_bits_as_the_graph(variant, dtype, tmp_path, monkeypatch, native_calls)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("native") / "llama"
    # a width of its own: graphs are shared by the process, and test_compiled_step's count the ones
    # they make;
    # its heads of 24 channels and its feed-forward of 200 meet the loops' tails
    make_toy_model(directory, layers=3, hidden=96, seed=5)
    return directory


def _answers(directory, batch: list[list[int]], params: SamplingParams):
    """What a warmed (compiled from its first step) paged engine answers: `batch[0]` alone, then all
    of `batch` submitted together (prompts' chunks beside other rows' decodes: mixed steps through
    the graphs)."""
    with open_engine(
        directory, max_step_tokens=32, compile_after=COMPILE_AFTER, prefix_caching=False
    ) as engine:
        engine.warm_up()
        alone = engine.submit(batch[0], params).result()
        together = [s.result() for s in [engine.submit(p, params) for p in batch]]
    return alone, together


def test_a_request_reads_the_same_logprobs_alone_or_among_others(
    toy, compiling, monkeypatch, native_calls
):
    """Decode-only steps of the engine go native, steps that also read a prompt's chunk go through
    the graphs: a request's logprobs are the same bits either way, and the same as an engine that
    never steps natively."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    batch = prompts(9, seed=11, lo=3, hi=40)
    alone, together = _answers(toy, batch, params)
    stepped = len(native_calls)
    # batches of decodes
    assert stepped >= params.max_tokens - 1 and any(shape[1] > 1 for shape in native_calls)
    assert (together[0].token_ids, together[0].logprobs) == (alone.token_ids, alone.logprobs)
    monkeypatch.setenv("STER_NATIVE_STACK", "0")
    graph_alone, graph_together = _answers(toy, batch, params)
    assert len(native_calls) == stepped
    assert (graph_alone.token_ids, graph_alone.logprobs) == (alone.token_ids, alone.logprobs)
    assert [(r.token_ids, r.logprobs) for r in graph_together] == [
        (r.token_ids, r.logprobs) for r in together
    ]


@pytest.mark.slow  # two warmed engines, about 40 s
def test_a_windowed_request_reads_the_same_logprobs_alone_or_among_others(
    tmp_path, compiling, monkeypatch, native_calls
):
    """Mistral's sliding window (5) over a paged cache whose blocks behind the window are given
    back: its native decodes read each row's last keys as the graph's do, alone or among others."""
    make_tiny("mistral", tmp_path / "mistral")
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    batch = prompts(6, seed=12, lo=3, hi=30)
    alone, together = _answers(tmp_path / "mistral", batch, params)
    assert any(shape[1] > 1 for shape in native_calls)
    assert (together[0].token_ids, together[0].logprobs) == (alone.token_ids, alone.logprobs)
    monkeypatch.setenv("STER_NATIVE_STACK", "0")
    _, graph_together = _answers(tmp_path / "mistral", batch, params)
    assert [(r.token_ids, r.logprobs) for r in graph_together] == [
        (r.token_ids, r.logprobs) for r in together
    ]


def _decode_ragged(
    model, prompts: list[list[int]], new: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """decode()'s logits and greedy tokens for prompts of several lengths, left-padded as
    model/cache.left_pad pads them."""
    return decode_from(model, *left_pad(prompts), new)


@pytest.mark.parametrize("variant", ["toy", pytest.param("mistral", marks=pytest.mark.slow)])
def test_a_ragged_batch_left_padded_as_generate_pads_it_steps_natively(
    variant, toy, tmp_path, compiling, monkeypatch, native_calls
):
    """Prompts of 3, 9 and 6 tokens left-padded to one width (left_pad's ragged batch): each row's
    decode steps read its keys from its first real one (within Mistral's window of 5 past it),
    natively, with the graph's bits and the eager layers' logits."""
    directory = toy
    if variant != "toy":
        directory = tmp_path / variant
        make_tiny(variant, directory)
    gen = torch.Generator().manual_seed(9)
    ragged = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 9, 6)]
    eager = load_model(resolve(str(directory))).model
    graph, native = (_compiled(directory, monkeypatch, way) for way in (False, True))
    native_calls.clear()
    got, got_tokens = _decode_ragged(native, ragged, NEW)
    assert native_calls == [(3, 1, native.cfg.hidden_size)] * (NEW - 1)
    want, want_tokens = _decode_ragged(graph, ragged, NEW)
    assert torch.equal(got, want) and got_tokens == want_tokens
    reference, reference_tokens = _decode_ragged(eager, ragged, NEW)
    close(got, reference)
    assert got_tokens == reference_tokens
    for row, prompt in enumerate(ragged):  # each row as the same prompt decoded alone
        alone, _ = _decode_ragged(eager, [prompt], NEW)
        close(got[:, row], alone[:, 0])


def test_an_attached_adapter_sends_steps_through_the_graph(
    toy, compiling, monkeypatch, native_calls
):
    eager, native = load_model(resolve(str(toy))).model, _compiled(toy, monkeypatch)
    sites = random_sites(eager, ("q", "v"), torch.Generator().manual_seed(3), scale=0.5)
    prompt = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(4))
    plain, _ = decode(native, prompt, NEW)
    detach = [attach(m, sites) for m in (eager, native)]
    try:
        native_calls.clear()
        got, got_tokens = decode(native, prompt, NEW)
        want, want_tokens = decode(eager, prompt, NEW)
    finally:
        for undo in detach:
            undo()
    assert native_calls == []
    close(got, want)
    # the adapter did change the logits
    assert got_tokens == want_tokens and not torch.allclose(got, plain)
    decode(native, prompt, 2)
    assert len(native_calls) == 1  # detached: native again


def test_a_layer_left_out_of_the_plan_sends_steps_through_the_graph(
    toy, compiling, monkeypatch, native_calls
):
    eager, native = load_model(resolve(str(toy))).model, _compiled(toy, monkeypatch)
    prompt = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(6))
    decode(native, prompt, 2)  # the first decode finds the plan's scales
    scales = native.compiled.scales
    monkeypatch.setattr(native.compiled, "scales", scales[:-1] + [0.0])
    native_calls.clear()
    got, _ = decode(native, prompt, NEW)
    want, _ = decode(eager, prompt, NEW)
    assert native_calls == []
    close(got, want)


@pytest.mark.parametrize(
    "variant, dtype, reason",
    [
        # the whole projection
        ("olmoe", "f32", "layer 0: it norms, clips or scales its queries, keys or values"),
        (
            "ministral3",
            "f32",
            "layer 0: it scales queries by position",
        ),  # Llama 4's query temperature
        (
            "granite_swa",
            "f32",
            "layer 0: its attention is not softmax, soft-capped or not",
        ),  # sinks
        (
            "olmo",
            "f32",
            "layer 0: its norms are not plain RMS norms before attention and feed-forward, or after both "
            "alone",
        ),  # layer norms
        # a layer scalar
        (
            "gemma4_text",
            "f32",
            "layer 0: it is not two pre-norm sublayers added to a plain residual",
        ),
        # residual multiplier
        ("hyperclovax", "f32", "layer 0: a sublayer's output is biased or scaled before its norm"),
    ],
)
def test_a_model_that_is_not_plain_says_why_it_steps_through_the_graph(
    variant, dtype, reason, tmp_path
):
    make_tiny(variant, tmp_path / variant)
    model = load_model(resolve(str(tmp_path / variant)), precision=dtype).model
    assert why_not(model) == reason


@pytest.mark.parametrize(
    "norms, refusal",
    [
        # before attention alone
        ({0: 8}, "has a norm before \\(or after\\) one sublayer and not the other"),
        ({}, "has no norm at all"),
        (
            {0: 8, 5: 8, 10: 4},
            "query and key norms are not both per head",
        ),  # a query norm, no key norm
        # whole queries, keys of 8 (not 4)
        ({0: 8, 5: 8, 10: 8, 11: 8}, "query and key norms are not both per head"),
    ],
)
def test_stack_step_refuses_norms_it_cannot_pair_before_any_layer_runs(norms, refusal):
    """Two query heads of 4 over one key head of 4: the shape checks come before any work, so a bad
    layer fails the call (and the step goes through the graph) before a layer has written the
    cache."""
    from ster_dist import kernels

    assert kernels.ready()
    weights = [
        torch.ones(norms[i]) if i in norms else torch.empty(0)
        for i in range(len(native_stack._READS))
    ]
    with pytest.raises(RuntimeError, match=refusal):
        torch.ops.ster_kernels.stack_step(
            torch.zeros(1, 8), weights, [0], [0.0] * 10, [2, 1, 4, 4, 0], [], [], [-1, 0]
        )


def _bytes_allocated_inside(event) -> int:
    """What the operators under a profiled operator allocated, in bytes: the sum over the innermost
    ones (aten::empty and its kin), as an outer operator's figure counts its inner ones' again."""
    return sum(
        _bytes_allocated_inside(child) if child.cpu_children else max(child.cpu_memory_usage, 0)
        for child in event.cpu_children
    )


@pytest.mark.parametrize("dtype,pack", [("f32", False), ("bf16", True)])
def test_a_native_step_allocates_nothing_but_its_output(
    toy, compiling, monkeypatch, native_calls, dtype, pack
):
    """Issue 18's fifth item: once a batch size was seen, a step's layers write into room the thread
    keeps (the products' outputs, the heads, attention's output, the normed rows); only the hidden
    states it returns are new. Through the few-row kernel (unpacked) and through panels (packed,
    bf16 widening its rows)."""
    if pack and not kernels.panels(torch.bfloat16):
        pytest.skip(
            "no bf16 panels in this build: oneDNN's products over packed copies allocate their own output"
        )
    model = _compiled(toy, monkeypatch, dtype=dtype)
    weights = pack_model(model, "on") if pack else []
    try:
        prompt = torch.randint(3, 300, (3, 7), generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            cache = model.new_cache(3, 7 + 4)
            logits = model(
                prompt,
                torch.arange(7).expand(3, 7),
                torch.ones_like(prompt, dtype=torch.bool),
                cache,
            )
            position = torch.full((3, 1), 7)
            for step in range(3):
                token = logits[:, -1].argmax(-1, keepdim=True)
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
                    logits = model(
                        token, position + step, torch.ones_like(token, dtype=torch.bool), cache
                    )
        assert native_calls == [(3, 1, model.cfg.hidden_size)] * 3
        steps = [e for e in profiled.events() if e.name == "ster_kernels::stack_step"]
        assert len(steps) == 1
        # the last step's: its returned hidden states, [3, hidden] of the model's dtype, and nothing
        # else
        assert _bytes_allocated_inside(steps[0]) == 3 * model.cfg.hidden_size * model.dtype.itemsize
    finally:
        packed.release(weights)


def test_native_steps_can_be_turned_off(toy, monkeypatch):
    model = load_model(resolve(str(toy))).model
    assert why_not(model) is None
    monkeypatch.setenv("STER_NATIVE_STACK", "0")
    assert why_not(model) == "STER_NATIVE_STACK=0 is set"


def test_vectors_of_another_width_than_inductors_keep_steps_with_the_graph(toy, monkeypatch):
    """Sums in vectors of another width are in another order: not the graph's bits, so not taken."""
    model = load_model(resolve(str(toy))).model
    lanes = torch.ops.ster_kernels.stack_lanes()
    assert native_stack._inductor_lanes() == lanes and why_not(model) is None
    monkeypatch.setattr(native_stack, "_inductor_lanes", lambda: 2 * lanes)
    assert (
        why_not(model)
        == f"inductor's loops here take {2 * lanes} floats a vector, the kernels' {lanes}"
    )


def test_a_native_step_that_fails_runs_again_through_the_graph(toy, compiling, monkeypatch, capfd):
    eager, native = load_model(resolve(str(toy))).model, _compiled(toy, monkeypatch)
    original = NativeStack.run

    def failing(self, h, step):  # fails after its first layer stored that layer's keys and values
        whole = self.layers, self.sources, self.numbers, self.rotations
        per_layer = len(self.numbers) // len(self.layers)
        self.layers, self.sources, self.numbers, self.rotations = (
            self.layers[:1],
            self.sources[: len(native_stack._READS)],
            self.numbers[:per_layer],
            self.rotations[:2],
        )
        try:
            original(self, h, step)
        finally:
            self.layers, self.sources, self.numbers, self.rotations = whole
        raise RuntimeError("stack_step: a check failed\nmore detail")

    monkeypatch.setattr(NativeStack, "run", failing)
    prompt = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(8))
    got, got_tokens = decode(native, prompt, NEW)
    want, want_tokens = decode(eager, prompt, NEW)
    close(got, want)
    assert got_tokens == want_tokens and native.compiled.native is None
    said = capfd.readouterr().err
    assert (
        said.count(
            "a native decode step failed (stack_step: a check failed); decode steps go through the compiled "
            "graphs from now on"
        )
        == 1
    )
