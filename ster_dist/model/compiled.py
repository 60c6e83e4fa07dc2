"""The compiled step (issue 18): each layer's token-wise work traced once by torch.compile and
reused by every layer of the same shape, attention left to the live step as one opaque operator.

Between two attention calls a decode step is a chain of small products and elementwise work (norms,
rotations, residual sums, activations): about seventy eager operator calls a layer, each a few
microseconds of dispatch and, on a CPU with several threads, a fork and join of the thread pool.
Compiled, the elementwise work between two products becomes one generated loop.

Attention is not traced: how it reaches its keys is the step's business (a static cache's slots, a
paged cache's block tables, masks by window) and its key count grows every step. As vLLM's piecewise
graphs do, it is a custom operator, `ster_dist::attend(q, k, v, layer)`, whose body runs the layer's
own attention through the live step, outside the graph. The graph sees only the operator's output
shape, which follows from the step's token count, so one graph serves every step whatever the cache
holds; the token count is a dynamic dimension, so one graph also serves a range of counts. The
ranges are where the traced code branches on the row count: 2-8 (dense()'s few-row kernel), 9-15 (on
f32 weights oneDNN's products) and 16 up (a bound inductor adds), each compiled on its first use; a
mixture of experts adds one where its (token, expert) rows pass the experts kernel's limit
(moe/experts.py: past it the experts run eagerly inside an opaque operator).

One compiled function runs every layer: the layer's parameters are its inputs (torch.compile's
inlining of nn.Modules), and nothing layer-specific reaches the graph as a constant: the operator's
`layer` is the layer's index as a 0-d tensor, an input like the parameters, and the step is in the
context this module keeps. Layers that differ in structure (a sliding window, another head count)
get a graph of their own, traced on first use.

Where every layer is plain Llama- or Gemma-shaped, a step of decodes only skips the graphs:
model/native_stack.py runs it as one call into C++ with the graph's bits (on the tests' shapes;
bench/README.md). A step of one token (one sequence decoding: a chat's every step) of other models
runs the whole stack in one graph instead, static in shape: each layer is a call of a
`nested_compile_region` traced once per layer structure, so the step enters compiled code once
rather than once a layer (guards and wrappers, about 50 us a layer). If that graph cannot be built,
one-token steps go layer by layer like the others.

Without the few-row kernel (kernels/), the head of a one-token step with bf16 / f16 weights runs
through a compiled `dense` (its one-row widening loop, parallel/linear.py), set as the model's
`VocabHead.product`.

Inside the graph the layers see a TracedStep instead of the live step: the token positions, the
layer's rotary tables (looked up by the live step beforehand), its own input where the model gives
each layer one (Gemma 3n, Gemma 4's E models: a graph input beside h) and `attend`. A layer that
reads an earlier layer's keys and values (their shared layers) attends through
`ster_dist::attend_shared`, whose body asks the live step for what the source layer stored or kept;
neither kind of layer is planned for the kernels, the live step holding their keys. Gemma 3n's
stream is AltUp's copies of h, [copies, batch, tokens, width] to each layer's graph, made before the
layers and collapsed after them outside the graphs. Models whose layers need more of the step
(recurrent states, state handed between layers, hooks, routed adapters) run eagerly: `why_eager`
says why. Routed experts trace as one operator, the experts kernel where it takes them and otherwise
`ster_dist::routed_experts` (moe/experts.py), whose body runs their eager branches; a MoE layer over
expert-parallel ranks or with identity experts is one operator whole, `ster_dist::moe_layer`
(moe/layer.py), its collectives inside; experts chosen by token id keep a model eager
(`_experts_eager`).
"""

from __future__ import annotations

import os
import time

import torch

from ster_dist.events import progress
from ster_dist.model.attention import Attention
from ster_dist.model.native_stack import NativeStack, why_not
from ster_dist.model.step import decode_kernel_terms
from ster_dist.moe.experts import Experts
from ster_dist.moe.layer import MoE, trace_moe
from ster_dist import kernels
from ster_dist.parallel.fp8 import Fp8Weight
from ster_dist.parallel.linear import dense

_RUNNING: list = []  # (live step, decoder) of the compiled step in flight: the operator's context


# defined through a Library rather than torch.library.custom_op: the operator runs once a layer
# every step, and
# custom_op's Python wrappers (its aliasing checks among them) cost about as much again as the
# dispatch itself
_LIBRARY = torch.library.Library("ster_dist", "FRAGMENT")
_LIBRARY.define("attend(Tensor q, Tensor k, Tensor v, Tensor layer) -> Tensor")
_LIBRARY.define("attend_shared(Tensor q, Tensor layer) -> Tensor")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    step, model = _RUNNING[-1]
    index = int(layer)
    mixer = model.layers[index].token_mixer
    # in the layout the graph was compiled for (the fake's): a paged step's decodes come back with
    # heads and
    # sequences transposed, and the graph reads its input by the strides it was traced with; a new
    # tensor
    # always, never one of the inputs (the schema says the output aliases nothing)
    return step.attend(
        index, q, k, v, mixer.window, mixer._attend_at, mixer.chunk, keep=mixer.keeps_kv
    ).contiguous()


def attend_shared(q: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """A layer without keys of its own (Gemma 3n's and Gemma 4's shared layers): its queries over
    the keys and values its source layer stored or kept earlier in the step, which the graph reaches
    through the residual."""
    step, model = _RUNNING[-1]
    mixer = model.layers[int(layer)].token_mixer
    return step.attend(
        mixer.kv_source, q, None, None, mixer.window, mixer._attend_at, mixer.chunk
    ).contiguous()


_LIBRARY.impl("attend", attend, "CompositeExplicitAutograd")
_LIBRARY.impl("attend_shared", attend_shared, "CompositeExplicitAutograd")


@torch.library.register_fake("ster_dist::attend")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    return q.new_empty((*q.shape[:3], v.shape[-1]))


@torch.library.register_fake("ster_dist::attend_shared")
def _(q: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    # values as wide as queries: why_eager keeps other shared layers eager
    return q.new_empty(q.shape)


class TracedStep:
    """What a compiled layer reads of its step: positions, its rotary tables, its own input (Gemma
    3n, Gemma 4's E models; None elsewhere) and attention. `layer` is the layer's index as a 0-d
    tensor, an input of the graph rather than a constant of it, so every layer of one structure
    shares the graph."""

    def __init__(
        self,
        positions: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        layer: torch.Tensor,
        own_input: torch.Tensor | None = None,
    ):
        self.positions = positions
        self._rotary = rotary
        self.layer = layer
        self._own_input = own_input

    def rotary(self, rope, dtype: torch.dtype):
        return self._rotary

    def layer_input(self, layer: int) -> torch.Tensor:
        return self._own_input

    def attend(
        self, layer: int, q, k, v, window, fn, chunk=None, keep: bool = False
    ) -> torch.Tensor:
        if k is None:  # a shared layer: its source's keys, which the live step holds
            return torch.ops.ster_dist.attend_shared(q, self.layer)
        # layers the step planned never call back into Python; the rest go to attend
        if kernels.ready():
            return torch.ops.ster_kernels.attend_planned(q, k, v, self.layer)
        return torch.ops.ster_dist.attend(q, k, v, self.layer)


def _kernel_terms(model) -> list[tuple[float, float] | None]:
    # a layer whose keys a later one reads, or that reads another's, attends through the live step,
    # which holds them
    probe = torch.empty(0, dtype=model.dtype, device=model.device)
    return [
        decode_kernel_terms(block.token_mixer._attend_at, probe, model.dtype)
        if type(block.token_mixer) is Attention
        and block.token_mixer.kv_source is None
        and not block.token_mixer.keeps_kv
        else None
        for block in model.layers
    ]


def decode_plans(model) -> list[float]:
    """Per layer, the decode kernel's scale where a planned step (kernels/paged_decode.cpp's
    attend_planned) may take the layer's attention: softmax attention, soft-capped or not, over a
    range of its keys (every earlier one, or a sliding window's or a chunk's, `decode_ranges`); 0
    elsewhere."""
    return [terms[0] if terms is not None else 0.0 for terms in _kernel_terms(model)]


def decode_ranges(model) -> tuple[list[int], list[int], list[float]]:
    """Per layer, the sliding window and the chunk a planned step's attention keeps to and the soft
    cap of its scores (push_plan's windows, chunks and softcaps; 0 where a layer has none), each
    list empty where no layer has one: nothing for push_plan to read each step."""
    mixers = [block.token_mixer for block in model.layers]
    windows, chunks = (
        [getattr(m, name, None) or 0 for m in mixers] for name in ("window", "chunk")
    )
    caps = [terms[1] if terms is not None else 0.0 for terms in _kernel_terms(model)]
    return (
        (windows if any(windows) else []),
        (chunks if any(chunks) else []),
        (caps if any(caps) else []),
    )


def _layer(
    block,
    h: torch.Tensor,
    positions: torch.Tensor,
    rotary,
    layer: torch.Tensor,
    batch: int,
    tokens: int,
    own: torch.Tensor | None = None,
    copies: int = 0,
) -> torch.Tensor:
    # flat in and out, so every layer's input has the strides the first one's had (guards check
    # them); `copies`:
    # the stream is AltUp's copies of h (Gemma 3n), [copies, batch, tokens, width] to the block
    own = own.view(batch, tokens, -1) if own is not None else None
    stream = h.view(copies, batch, tokens, -1) if copies else h.view(batch, tokens, -1)
    out = block(stream, TracedStep(positions.view(batch, tokens), rotary, layer, own))
    return out.reshape(-1, out.shape[-1])


@torch.compiler.nested_compile_region
def _one_token_layer(
    block,
    h: torch.Tensor,
    positions: torch.Tensor,
    rotary,
    layer: torch.Tensor,
    own: torch.Tensor | None,
) -> torch.Tensor:
    return block(h, TracedStep(positions, rotary, layer, own))


def _one_token_layers(
    blocks, h: torch.Tensor, positions: torch.Tensor, rotaries, layers, owns
) -> torch.Tensor:
    # one graph for the whole stack, each layer one call of a region traced once per layer structure
    for block, rotary, layer, own in zip(blocks, rotaries, layers, owns):
        h = _one_token_layer(block, h, positions, rotary, layer, own)
    return h


def why_eager(model) -> str | None:
    """Why `model`'s steps cannot be compiled (None: they can)."""
    if os.environ.get("STER_ENFORCE_EAGER") == "1":
        return "STER_ENFORCE_EAGER=1 is set"
    if model.device.type != "cpu":
        return f"compiled steps are built for CPU only in this version (the model is on {model.device.type})"
    cfg = model.cfg
    # (per-layer inputs are handed to each layer, AltUp's copies are its stream)
    if model.ngram is not None:
        return "the model reads per-step inputs beyond token ids and positions"
    if cfg.block_skips or model.loop.stacks or model.loop_init is not None or cfg.hyper_streams:
        return "the model loops over, skips or widens its layers"
    if model.ctx.pp_size > 1:
        return "the model is split into pipeline stages"
    for i in range(*model.stage):
        block = model.layers[i]
        mixer = block.token_mixer
        if type(mixer) is not Attention:
            return f"layer {i} is {type(mixer).__name__}, not plain attention"
        if mixer.alibi_sqrt:
            return f"layer {i} biases by each query's position"
        if mixer.kv_source is not None and mixer.value_dim != mixer.head_dim:
            return f"layer {i} reads another layer's values, wider or narrower than its queries"
        if block.shortcut is not None or block.joins_shortcut or block.attn_sconv is not None:
            return f"layer {i} hands state to a later layer"
        if (reason := _experts_eager(model, block)) is not None:
            return f"layer {i} {reason}"
    if any(isinstance(p, Fp8Weight) for p in model.modules()):
        return "FP8 weights are kept"
    return None


def _experts_eager(model, block) -> str | None:
    """Why `block`'s routed experts keep its steps eager (None: they trace). A step's experts trace
    as one kernel operator where it takes them (moe/experts.py's `fused`), and every other way
    through them as one opaque operator (`routed_experts`); a layer over expert-parallel ranks or
    with identity experts is one opaque operator whole (moe/layer.py's `moe_layer`), so no graph
    splits around them. Routing by token id needs the step's ids, which a traced step does not hand
    on."""
    if not any(isinstance(m, Experts) for m in block.modules()):
        return None
    if any(m.hash_routed for m in block.modules() if isinstance(m, MoE)):
        return "routes tokens by token id"
    return None


class CompiledLayers:
    """The decoder's layers, each run through one compiled function; `run(h, step)` is `_layers(h,
    step)`."""

    def __init__(self, model):
        self.model = model
        # a graph per layer structure and per token count of one or more: more than torch's default
        # of 8
        # when layers differ (sliding and global, per-layer head counts)
        # one compiling thread: a pool of compile workers costs more to start than it saves
        # (measured here: a
        # tiny model's first graph in 8 s against 100 s on 2 busy cores); the setting is
        # process-wide
        import torch._inductor.config

        torch._inductor.config.compile_threads = 1
        kernels.ready()  # built (or found) now: a graph being traced only asks whether it is there
        # without inductor's checks of every input's and output's sizes and strides at each call
        # (thirty-odd
        # calls a layer): the graph's inputs are a layer's own parameters, checked by its guards
        # already
        self.fn = torch.compile(_layer, dynamic=True, options={"size_asserts": False})
        # a step of one token (one sequence decoding) runs every layer in one graph: one entry into
        # a compiled
        # function a step instead of one a layer (about 50 us each of guards and wrappers: 1.5 ms of
        # a
        # 30-layer step). Its shapes are static: torch's regions reused across layers fail on
        # dynamic ones.
        self.one_token = torch.compile(
            _one_token_layers, dynamic=False, options={"size_asserts": False}
        )
        self.stacked = True  # until the one-token graph fails to build
        # what the graphs' routed_experts and moe_layer operators find their layers by
        trace_moe(model)
        self.layer_ids = [torch.tensor(i) for i in range(len(model.layers))]
        # the head of a one-token step in bf16 / f16 through dense's compiled one-row loop
        # (parallel/linear.py):
        # SmolLM2's 57 MB bf16 head in 2.9 ms against 5.5 ms through oneDNN
        self.head = torch.compile(dense, dynamic=False)
        if model.lm_head is not None:
            model.lm_head.product = self.head_product
        self.graphs = 0
        self.scales: list[float] | None = None  # decode_plans, found at the first step
        # decode_ranges, with them
        self.ranges: tuple[list[int], list[int], list[float]] = ([], [], [])
        # decode steps of plain Llama- or Gemma-shaped layers as one native call
        # (model/native_stack.py)
        self.native_why_not = why_not(model)
        self.native = NativeStack(model) if self.native_why_not is None else None

    def run(self, h: torch.Tensor, step) -> torch.Tensor:
        model = self.model
        plan = self._plan(step)
        if plan is not None and self.native is not None and self.native.takes(plan[2]):
            torch.ops.ster_kernels.push_plan(*plan)
            try:
                return self.native.run(h, step)
            # the step runs again through the graph: it writes the same slots
            except RuntimeError as error:
                self.native = None
                progress(
                    f"a native decode step failed ({str(error).strip().splitlines()[0][:200]}); "
                    "decode steps go through the compiled graphs from now on"
                )
            finally:
                torch.ops.ster_kernels.pop_plan()
        tables = {}
        started, before = time.perf_counter(), _graph_count()
        *copies, batch, tokens, width = h.shape  # copies: AltUp's (Gemma 3n), or none
        layers = range(*model.stage)
        rotaries = []
        for i in layers:
            rope = model.layers[i].token_mixer.rope
            if rope is not None and rope not in tables:
                tables[rope] = step.rotary(rope, model.dtype)
            rotaries.append(tables.get(rope))
        ids = self.layer_ids[layers.start : layers.stop]
        owns = self._own_inputs(step, layers, batch * tokens)
        if plan is not None:
            torch.ops.ster_kernels.push_plan(*plan)
        _RUNNING.append((step, model))
        try:
            with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
                if batch * tokens == 1 and self.stacked:
                    try:
                        out = self.one_token(
                            list(model.layers)[layers.start : layers.stop],
                            h,
                            step.positions.reshape(1, 1),
                            rotaries,
                            ids,
                            [o.view(1, 1, -1) if o is not None else None for o in owns],
                        )
                    # the step runs again layer by layer: it writes the same slots
                    except failures() as error:
                        self.stacked = False
                        progress(
                            f"compiling the one-token stack failed ({str(error).strip().splitlines()[0][:200]});"
                            " one-token steps run layer by layer from now on"
                        )
                    else:
                        self._report(before, started, "one-token stack graph(s)")
                        return out
                h, positions = h.reshape(-1, width), step.positions.reshape(-1).contiguous()
                for i, rotary, layer, own in zip(layers, rotaries, ids, owns):
                    h = self.fn(
                        model.layers[i], h, positions, rotary, layer, batch, tokens, own, *copies
                    )
        finally:
            _RUNNING.pop()
            if plan is not None:
                torch.ops.ster_kernels.pop_plan()
        self._report(before, started, f"step graph(s) for {batch * tokens} tokens")
        return h.view(*copies, batch, tokens, -1)

    def _own_inputs(self, step, layers: range, rows: int) -> list[torch.Tensor | None]:
        """Each layer's own input of the step, flat [rows, width] as the graphs take h (Gemma 4's E
        models), or None for every layer where the model has none."""
        if self.model.per_layer_inputs is None:
            return [None] * len(layers)
        return [step.layer_input(i).reshape(rows, -1) for i in layers]

    def _plan(self, step) -> tuple | None:
        """What a decode step tells the kernels before its graph runs (push_plan's arguments), or
        None."""
        planner = getattr(step, "decode_plan", None)
        if planner is None or not kernels.ready():
            return None
        if self.scales is None:
            self.scales, self.ranges = decode_plans(self.model), decode_ranges(self.model)
        return planner(self.scales, self.model.dtype, self.ranges)

    def head_product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The head's x W^T (+ b): compiled for one row of a bf16 / f16 weight, through dense
        otherwise."""
        if (
            x.numel() != x.shape[-1]
            or weight.dtype not in (torch.bfloat16, torch.float16)
            or x.dtype != weight.dtype
            # the few-row kernel takes it as it is
            or (weight.dtype == torch.bfloat16 and kernels.ready())
        ):
            return dense(x, weight, bias)
        started, before = time.perf_counter(), _graph_count()
        try:
            y = self.head(x, weight, bias)
        except failures() as error:
            self.stop()
            progress(
                f"compiling the head failed ({str(error).strip().splitlines()[0][:200]}); "
                "its product runs eagerly from now on"
            )
            return dense(x, weight, bias)
        self._report(before, started, "head graph(s) for one row")
        return y

    def stop(self) -> None:
        """Compiling is off for good (a graph failed): the head's product is dense's again."""
        if self.model.lm_head is not None:
            self.model.lm_head.product = dense

    def _report(self, before: int, started: float, what: str) -> None:
        made = _graph_count() - before
        if made:
            self.graphs += made
            progress(
                f"compiled {made} {what} in {time.perf_counter() - started:.1f} s "
                "(paid once; --enforce-eager turns compiling off)"
            )


def _graph_count() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def failures() -> tuple[type[Exception], ...]:
    """What compiling raises when it cannot handle a layer (imported late: inductor is slow to
    import)."""
    from torch._inductor.exc import InductorError

    return torch._dynamo.exc.TorchDynamoException, InductorError
