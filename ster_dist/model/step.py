"""StepState: what every layer of one forward step shares (positions, cache slots, masks by window
and chunk, rotary tables by rope and dtype). Built once per step by the decoder, read by every
attention kind; it sits in its own module so attention need not import the decoder.

Attention reaches its keys only through `attend`, so a step over a paged cache (PagedStep) can
store and gather them its own way while the attention math stays the layer's."""

from __future__ import annotations

import functools

import torch

from ster_dist import kernels
from ster_dist.config import RopeConfig
from ster_dist.model.cache import KVCache
from ster_dist.model.host import upload
from ster_dist.model.rope import RotaryTables


class StepState:
    """What every layer of one forward step shares: positions, cache slots, masks and rotary
    tables."""

    def __init__(
        self,
        positions: torch.Tensor,
        valid: torch.Tensor,
        tables: RotaryTables,
        cache: KVCache | None,
        bidirectional_prompt: bool = False,
        device: torch.device | None = None,
    ):
        """positions and valid [batch, seq] as the caller built them, on the host (model/host.py:
        every decision here reads them there); the layers read them, the masks and the rotary tables
        on
        `device`
        (positions' own by default)."""
        device = positions.device if device is None else device
        # themselves when built on the host, as callers do
        positions, valid = positions.cpu(), valid.cpu()
        self.device = device
        self.positions = upload(positions, device)
        # [batch, seq] where some token is padding
        self.padding = None if bool(valid.all()) else upload(valid, device)
        self.tables = tables
        self.cache = cache
        if cache is not None:
            self.slots = cache.reserve(positions, valid)
            key_pos, key_valid = (
                cache.positions[:, : self.slots.stop],
                cache.valid[:, : self.slots.stop],
            )
            start = self.slots.start
        else:
            self.slots, key_pos, key_valid, start = None, positions, valid, 0
        t, s = positions.shape[1], key_pos.shape[1]
        both_ways = bidirectional_prompt and cache is not None and start == 0 and t > 1
        # the masks', built on first use
        self._start, self._key_valid, self._both_ways = start, key_valid, both_ways
        # where the mask is causal alone over slots that are positions (no padding, no prompt read
        # both ways):
        # the first query's slot, for the causal kernel; None elsewhere
        causal = (
            t > 1
            and not both_ways
            and device.type == "cpu"  # the kernel is a CPU one
            and bool(key_valid.all())
            and bool((key_pos == torch.arange(s)).all())
        )
        self._causal_start = start if causal else None
        self._positions, self._key_pos = positions, key_pos  # the host's
        # a one-token step over keys that are all real sees every key: no mask to build or apply
        self._unmasked = t == 1 and bool(key_valid.all())
        # per (window, chunk): the decode kernel's table, first keys and ends, or None where a row's
        # keys are not
        # one run (`_kernel_rows`)
        self._rows: dict[tuple[int | None, int | None], tuple | None] = {}
        self._masks: dict[tuple[int | None, int | None], torch.Tensor | None] = {}
        self._rotary: dict[tuple[RopeConfig, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        # what a layer hands on to later layers of this step (GLM-DSA's shared top-k choice,
        # model/mla.py)
        self.handed_on: dict = {}

    def layer_input(self, layer: int) -> torch.Tensor:
        """`layer`'s own input of this step [batch, seq, width] (Gemma 3n, Gemma 4's E models)."""
        return self.per_layer_inputs[..., layer, :]

    def mask(self, window: int | None, chunk: int | None = None) -> torch.Tensor | None:
        """[batch, 1, queries, keys] of allowed pairs, or None when every key is allowed. `chunk`: a
        query sees only keys whose position lies in its own chunk of that many positions (Llama
        4)."""
        if (window, chunk) not in self._masks:
            near = None
            if window is not None:
                near = self._positions.unsqueeze(2) - self._key_pos.unsqueeze(1) < window
            if chunk is not None:
                same = self._positions.unsqueeze(2) // chunk == self._key_pos.unsqueeze(1) // chunk
                near = same if near is None else near & same
            if self._unmasked and (near is None or bool(near.all())):
                self._masks[window, chunk] = None
            else:
                base, diagonal = self._base
                allowed = base if near is None else base & near
                self._masks[window, chunk] = upload((allowed | diagonal).unsqueeze(1), self.device)
        return self._masks[window, chunk]

    @functools.cached_property
    def _base(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, queries, keys] the causal pairs between real keys (or, for a prompt read both
        ways, every real key), and [1, queries, keys] each query's own slot: what every mask starts
        from, built only where a layer asks for a mask (a decode step over real keys never does)."""
        t, s = self._positions.shape[1], self._key_pos.shape[1]
        query_slot = torch.arange(self._start, self._start + t).view(1, t, 1)
        key_slot = torch.arange(s).view(1, 1, s)
        if self._both_ways:
            # a prompt read whole from position zero (a prefix LM's): each of its tokens sees all of
            # its tokens
            base = self._key_valid.unsqueeze(1).expand(-1, t, -1)
        else:
            base = (key_slot <= query_slot) & self._key_valid.unsqueeze(1)
        return base, key_slot == query_slot  # every query sees itself, so padding rows stay finite

    def attend(
        self,
        layer: int,
        q,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        window: int | None,
        fn,
        chunk: int | None = None,
        keep: bool = False,
    ):
        """fn(q, keys, values, mask, key_positions) over every key this step sees (within `window`
        positions and the query's `chunk`, where stated): this step's keys and values [batch, heads,
        seq, width] are stored in the cache first, where there is one. `keep`: a later layer reads
        these keys and values, which the step holds for it; k and v None: attend what `layer` kept
        (Gemma 3n's shared layers)."""
        if k is None:
            k, v = self.handed_on["kv", layer]
        else:
            if self.cache is not None:
                k, v = self.cache.write(layer, self.slots, k, v)
            if keep:
                self.handed_on["kv", layer] = k, v
        terms = self._in_place_terms(q, k, fn, window, chunk)
        # one query a row over one run of keys: read where the cache holds them
        if terms is not None:
            return self._in_place(q, k, v, *terms, window, chunk)
        terms = self._causal_terms(q, k, v, fn, chunk)
        # a prompt's queries over the keys before them, the masked half never computed
        if terms is not None:
            return self._causal(q, k, v, *terms, window)
        return fn(q, k, v, self.mask(window, chunk), self.key_positions)

    def _causal_terms(self, q, k: torch.Tensor, v: torch.Tensor, fn, chunk: int | None):
        """decode_kernel_terms where the causal kernel may take this step's attention; None: call
        fn."""
        if self._causal_start is None or chunk is not None or not causal_kernel_fits(q, k, v):
            return None
        return decode_kernel_terms(fn, q, k.dtype)

    def _causal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        softcap: float,
        window: int | None,
    ):
        # keys [batch, heads, keys, width] seen as [batch, keys, heads, width]: a paged cache of one
        # block a row
        batch = q.shape[0]
        rows = torch.arange(batch).view(batch, 1)
        starts = torch.full((batch,), self._causal_start, dtype=torch.long)
        return torch.ops.ster_kernels.causal_attend(
            q, k.transpose(1, 2), v.transpose(1, 2), rows, starts, window or 0, scale, softcap
        )

    def _in_place_terms(self, q, k: torch.Tensor, fn, window: int | None, chunk: int | None):
        """decode_kernel_terms where each row's one query sees one run of keys up to its own; None:
        call fn."""
        if self._positions.shape[1] != 1 or k.shape[2] != self._key_pos.shape[1]:
            return None
        terms = decode_kernel_terms(fn, q, k.dtype)
        return terms if terms is not None and self._kernel_rows(window, chunk) is not None else None

    def _in_place(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        softcap: float,
        window,
        chunk,
    ):
        # keys [batch, heads, keys, width] seen as [batch, keys, heads, width]: a paged cache of one
        # block a row
        rows, starts, ends = self._kernel_rows(window, chunk)
        out = torch.ops.ster_kernels.paged_decode(
            q[:, :, 0], k.transpose(1, 2), v.transpose(1, 2), rows, starts, ends, scale, softcap
        )
        return out.unsqueeze(2)

    def _kernel_rows(self, window: int | None, chunk: int | None) -> tuple | None:
        """(table, first keys, ends) of the decode kernel for a one-token step's layer with this
        window and chunk, each row one block of the cache: the keys its mask allows, where they are
        one run ending at its own (left padding, as model/cache.left_pad pads a ragged batch, comes
        before a row's first key, and a window or a chunk cuts from the front); None where a row's
        allowed keys are not one such run."""
        if (window, chunk) not in self._rows:
            batch, keys = self._key_pos.shape
            mask = self.mask(window, chunk)
            if mask is None:
                first = torch.zeros(batch, dtype=torch.long)
            else:  # the host's (the kernel runs on the CPU only)
                allowed = mask.view(batch, keys).cpu()
                first = keys - allowed.sum(1)
                if not bool((allowed == (torch.arange(keys) >= first.view(batch, 1))).all()):
                    first = None
            self._rows[window, chunk] = (
                None
                if first is None
                else (
                    torch.arange(batch).view(batch, 1),
                    first,
                    torch.full((batch,), keys, dtype=torch.long),
                )
            )
        return self._rows[window, chunk]

    def decode_plan(
        self, scales: list[float], dtype: torch.dtype, ranges: tuple[list, list, list]
    ) -> tuple | None:
        """ster_kernels::push_plan's arguments where every row of this step decodes one token over
        one run of the keys of a static cache in `dtype` (all of them, or after a row's left
        padding): layer i planned where scales[i] > 0 (compiled.decode_plans), within its window and
        chunk and under its soft cap (`ranges`, compiled.decode_ranges); None otherwise."""
        if (
            self.cache is None
            or self._positions.shape[1] != 1
            or (found := self._kernel_rows(None, None)) is None
        ):
            return None
        rows, starts, ends = found
        windows, chunks, _ = ranges
        # layers with neither window nor chunk read `found` itself: nothing to check for them
        for window, chunk in set(zip(windows or [0] * len(scales), chunks or [0] * len(scales))) - {
            (0, 0)
        }:
            # the plan cuts a row's keys as Plan::first_keys does (from the end back, chunks counted
            # from slot
            # 0): after padding that must still be what its mask allows
            want = self._kernel_rows(window or None, chunk or None)
            first = starts.clone()
            if window:
                first = torch.maximum(first, ends - window)
            if chunk:
                first = torch.maximum(first, (ends - 1) // chunk * chunk)
            if want is None or not torch.equal(want[1], first):
                return None
        keys, values = self.cache.kernel_views()
        planned = planned_scales(scales, keys, dtype)
        if planned is None:
            return None
        batch = rows.shape[0]
        return (
            or_empty(keys),
            or_empty(values),
            planned,
            rows.view(batch),
            torch.full((batch,), self.slots.start, dtype=torch.long),
            rows,
            starts,
            ends,
            False,
            *ranges,
        )

    def attend_again(
        self, layer: int, q: torch.Tensor, fn, fresh: tuple[torch.Tensor, torch.Tensor] | None
    ):
        """fn(q, keys, values, causal mask, key_positions) over the keys an earlier layer of this
        step stored (a looped model's first pass, model/loop_attention.py): its cache, or without
        one the keys and values it handed on (`fresh`)."""
        k, v = self.cache.read(layer, self.slots.stop) if self.cache is not None else fresh
        return fn(q, k, v, self.mask(None), self.key_positions)

    def recur(self, layer: int, x: torch.Tensor, scan, fresh) -> torch.Tensor:
        """A recurrent layer's output for x [batch, seq, hidden]: scan(x, valid, state) -> (y,
        state) over the whole batch, state being each row's (fresh(batch) at the first step, else
        what the last step left in the cache). valid [batch, seq] is None when every token is real;
        a padding token must leave a row's state as it was (left padding comes before a row's first
        token, and its output is never read)."""
        state = self.cache.states.get(layer) if self.cache is not None else None
        if state is None:
            state = fresh(x.shape[0])
        y, state = scan(x, self.padding, state)
        if self.cache is not None:
            self.cache.states[layer] = state
        return y

    @functools.cached_property
    def key_reach(self) -> int:
        """One past the largest key position any attend call of this step sees, from the host's
        copy: what a layer sizes by the keys' positions asks instead of reading them from the device
        (model/host.py)."""
        return int(self._key_pos.max()) + 1

    @functools.cached_property
    def key_positions(self) -> torch.Tensor:
        """[batch, keys]: the absolute positions of the keys this step attends (ALiBi's biases), on
        the device."""
        return upload(self._key_pos, self.device)

    def rotary(self, rope: RopeConfig, dtype: torch.dtype):
        key = (rope, dtype)
        if key not in self._rotary:
            cos, sin = self.tables.lookup(rope, self._positions, dtype)
            self._rotary[key] = upload(cos, self.device), upload(sin, self.device)
        return self._rotary[key]


def planned_scales(
    scales: list[float], keys: list[torch.Tensor | None], dtype: torch.dtype
) -> list[float] | None:
    """The scales of the layers a decode plan covers (an attention cache in `dtype`; 0 for the
    rest), or None when it covers none."""
    planned = [s if k is not None and k.dtype == dtype else 0.0 for s, k in zip(scales, keys)]
    return planned if any(planned) else None


def or_empty(tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The list with an empty tensor for each None: a Tensor[] argument of an operator."""
    return [t if t is not None else torch.empty(0) for t in tensors]


def causal_kernel_fits(q, keys: torch.Tensor | None, values: torch.Tensor | None) -> bool:
    """Whether kernels/causal_attend.cpp reads these queries, keys and values as they are: several
    queries a row, each query's, key's and value's channels contiguous, values a multiple of 16 wide
    (its registers', AVX2's or AVX-512's), and no gradient asked of them (the kernel has no
    backward: training reads take SDPA)."""
    if not (
        isinstance(q, torch.Tensor)
        and q.dim() == 4
        and q.shape[2] > 1
        and q.stride(-1) == 1
        and keys is not None
        and values is not None
        and values.shape[-1] % 16 == 0
        and keys.stride(-1) == 1
        and values.stride(-1) == 1
    ):
        return False
    return not (
        torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad)
    )


def decode_kernel_terms(fn, q, key_dtype: torch.dtype) -> tuple[float, float] | None:
    """(scale, soft cap or 0) of `fn`'s attention where the decode kernel (kernels/paged_decode.cpp)
    may compute it in fn's place: fn is a layer's own softmax attention, soft-capped or not
    (Attention.kernel_terms), q a CPU tensor in f32 or bf16 with keys of its dtype, and the kernels
    are built; None otherwise."""
    if (
        not isinstance(q, torch.Tensor)
        or q.device.type != "cpu"
        or q.dtype not in (torch.float32, torch.bfloat16)
    ):
        return None
    kernel_terms = getattr(getattr(fn, "__self__", None), "kernel_terms", None)
    terms = kernel_terms(fn) if kernel_terms is not None and key_dtype == q.dtype else None
    return terms if terms is not None and kernels.ready() else None
