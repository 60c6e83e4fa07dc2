"""PagedStep: what every layer of one packed step over a PagedCache shares, as StepState is for the
static cache: positions of the packed tokens, their cache slots, rotary tables, and how attention
splits the packed tokens by sequence.

Token-wise layers see the step's tokens packed as [1, tokens, hidden], so no sequence is padded to
the longest. Only attention needs them by sequence: each attend call gathers its sequences' keys
from their block tables and runs the layer's own attention over them. One-token chunks (decodes)
share one call, one query each, their tables padded with the null block to the longest; every longer
chunk (prefill) gets its own call, so no query is padding and the key padding is bounded by the
decodes' spread of lengths.
"""

from __future__ import annotations

import functools

import torch

from ster_dist.config import RopeConfig
from ster_dist.kernels import select
from ster_dist.model.host import upload
from ster_dist.model.paged import Chunk, PagedCache
from ster_dist.model.rope import RotaryTables
from ster_dist.model.step import causal_kernel_fits, decode_kernel_terms, or_empty, planned_scales
from ster_dist.model.triton_attend import attend_group, triton_terms


class _AttendGroup:
    """Sequences that share one attend call: their queries' packed indices and block tables [n,
    blocks] (on the device), query positions [n, queries] (the host's, model/host.py); masks by
    window, built on first use."""

    def __init__(
        self,
        tokens: slice | torch.Tensor,
        table: torch.Tensor,
        query_pos: torch.Tensor,
        block_size: int,
        device: torch.device,
        prefix: int = 0,
    ):
        self.device = device
        self.tokens = tokens if isinstance(tokens, slice) else upload(tokens, device)
        self.table, self.query_pos, self.prefix = upload(table, device), query_pos, prefix
        # queries come from n sequences
        self.one_token = query_pos.shape[1] == 1 and table.shape[0] > 1
        keys = table.shape[1] * block_size
        # a key's slot in the gathered table is its position: sequences fill their blocks from
        # position 0
        self._key_pos = torch.arange(keys).expand(table.shape[0], keys)
        self._masks: dict[tuple[int | None, int | None], torch.Tensor | None] = {}
        self._ranges: dict[tuple[int | None, int | None], tuple[torch.Tensor, torch.Tensor]] = {}

    @functools.cached_property
    def key_pos(self) -> torch.Tensor:
        """[n, keys] each gathered key's position, on the device (what a layer's attention
        reads)."""
        return upload(self._key_pos, self.device)

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        """Each sequence's first query position: what the causal kernel asks of a prompt's group."""
        return upload(self.query_pos[:, 0].contiguous(), self.device)

    def take(self, x):
        """This group's queries [n, heads, q, width] from packed x [1, heads, tokens, width] (or a
        tuple of such)."""
        if isinstance(x, tuple):
            return tuple(self.take(part) for part in x)
        if self.one_token:
            return x[0][:, self.tokens].transpose(0, 1).unsqueeze(2)
        return x[:, :, self.tokens]

    def put(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Write this group's outputs y [n, heads, q, width] into packed out [1, heads, tokens,
        width]."""
        if self.one_token:
            out[0][:, self.tokens] = y[:, :, 0].transpose(0, 1)
        else:
            out[:, :, self.tokens] = y

    def packed(self, y: torch.Tensor) -> torch.Tensor:
        """y [n, heads, q, width] as packed [1, heads, tokens, width] when this group is the whole
        step."""
        return y[:, :, 0].transpose(0, 1).unsqueeze(0) if self.one_token else y

    def mask(self, window: int | None, chunk: int | None = None) -> torch.Tensor | None:
        """[n, 1, queries, keys] of allowed pairs (causal within the sequence, inside the window and
        the query's chunk), or None when every key is allowed. Causality alone excludes the padding
        slots: they lie past every query."""
        if (window, chunk) not in self._masks:
            key_pos = self._key_pos[:, None, :]
            distance = self.query_pos.unsqueeze(2) - key_pos
            allowed = distance >= 0
            if self.prefix:  # a prefix LM's prompt, read whole: its tokens see each other both ways
                allowed |= (self.query_pos.unsqueeze(2) < self.prefix) & (key_pos < self.prefix)
            if window is not None:
                allowed &= distance < window
            if chunk is not None:  # Llama 4's chunked layers: keys of the query's own chunk only
                allowed &= self.query_pos.unsqueeze(2) // chunk == key_pos // chunk
            self._masks[window, chunk] = (
                None if bool(allowed.all()) else upload(allowed.unsqueeze(1), self.device)
            )
        return self._masks[window, chunk]

    def key_range(
        self, window: int | None, chunk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For sequences of one query each: [n] first and [n] one-past-last positions of the keys
        its mask allows (causal, inside the window and the query's chunk), the mask as a range."""
        if (window, chunk) not in self._ranges:
            pos = self.query_pos[:, 0]
            first = torch.zeros_like(pos)
            if window is not None:
                first = (pos + 1 - window).clamp(min=0)
            if chunk is not None:
                first = torch.maximum(first, pos // chunk * chunk)
            self._ranges[window, chunk] = upload(first, self.device), upload(pos + 1, self.device)
        return self._ranges[window, chunk]


class PagedStep:
    """One packed step over a PagedCache: positions [1, tokens], cache slots, attend groups, rotary
    tables."""

    def __init__(
        self,
        chunks: list[Chunk],
        cache: PagedCache,
        tables: RotaryTables,
        ids: torch.Tensor,
        device: torch.device | None = None,
    ):
        """Everything is built from the chunks on the host and what the layers read goes to `device`
        (ids' own by default) once: no decision here reads the device (model/host.py)."""
        if not chunks:
            raise ValueError("a paged step needs at least one chunk")
        total = sum(c.length for c in chunks)
        if tuple(ids.shape) != (total,):
            raise ValueError(
                f"ids of shape {tuple(ids.shape)} for chunks of {total} new tokens in all"
            )
        bs, device = cache.block_size, ids.device if device is None else device
        self.cache, self.tables, self.device = cache, tables, device
        positions: list[int] = []
        slots: list[int] = []
        needed: list[int] = []
        for c in chunks:
            end = c.start + c.length
            need = -(-end // bs)
            if c.prefix and (c.start > 0 or c.length < c.prefix):
                raise ValueError(
                    f"{c}: a prompt attending both ways is read whole, from position 0"
                )
            if c.length < 1 or c.start < 0 or len(c.blocks) < need:
                raise ValueError(
                    f"{c}: needs length >= 1, start >= 0 and {need} blocks of {bs} positions"
                )
            written = c.blocks[c.start // bs : need]
            if PagedCache.NULL_BLOCK in written or not all(
                0 < b < cache.num_blocks for b in written
            ):
                raise ValueError(
                    f"{c}: new tokens go to blocks {written}; the null block {PagedCache.NULL_BLOCK} "
                    f"and ids outside [1, {cache.num_blocks}) cannot be written"
                )
            positions.extend(range(c.start, end))
            slots.extend(c.blocks[p // bs] * bs + p % bs for p in range(c.start, end))
            needed.append(need)
        self._positions = torch.tensor(positions).unsqueeze(0)  # the host's
        self.positions = upload(self._positions, device)
        self.slots = upload(torch.tensor(slots), device)
        offsets = [0]
        for c in chunks:
            offsets.append(offsets[-1] + c.length)
        self.last_tokens = upload(torch.tensor(offsets[1:]) - 1, device)
        self._offsets, self._ends = offsets, [c.start + c.length for c in chunks]
        self.total = total
        self.groups = self._groups(chunks, offsets, needed, bs, device)
        self._scans = self._scan_groups(chunks, offsets, device) if cache.states else []
        self._rotary: dict[tuple[RopeConfig, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        # what a layer hands on to later layers of this step (GLM-DSA's shared top-k choice,
        # model/mla.py)
        self.handed_on: dict = {}

    @staticmethod
    def _groups(
        chunks: list[Chunk], offsets: list[int], needed: list[int], bs: int, device
    ) -> list[_AttendGroup]:
        groups = []
        decodes = [i for i, c in enumerate(chunks) if c.length == 1]
        if decodes:
            at = [offsets[i] for i in decodes]
            contiguous = at == list(range(at[0], at[0] + len(at)))
            tokens = slice(at[0], at[0] + len(at)) if contiguous else torch.tensor(at)
            width = max(needed[i] for i in decodes)
            table = [
                list(chunks[i].blocks[: needed[i]]) + [PagedCache.NULL_BLOCK] * (width - needed[i])
                for i in decodes
            ]
            starts = [[chunks[i].start] for i in decodes]
            groups.append(
                _AttendGroup(tokens, torch.tensor(table), torch.tensor(starts), bs, device)
            )
        for i, c in enumerate(chunks):
            if c.length > 1:
                table = torch.tensor([c.blocks[: needed[i]]])
                query_pos = torch.arange(c.start, c.start + c.length).unsqueeze(0)
                groups.append(
                    _AttendGroup(
                        slice(offsets[i], offsets[i + 1]), table, query_pos, bs, device, c.prefix
                    )
                )
        return groups

    @staticmethod
    def _scan_groups(
        chunks: list[Chunk], offsets: list[int], device
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Chunks of one length scan together: (packed token indices [n, length], state slots [n],
        which of them start their sequence [n], or None where none does)."""
        by_length: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            if c.state < 0:
                raise ValueError(
                    f"{c}: a model with recurrent layers needs each sequence's state slot"
                )
            by_length.setdefault(c.length, []).append(i)
        groups = []
        for length, members in by_length.items():
            tokens = torch.tensor([list(range(offsets[i], offsets[i] + length)) for i in members])
            slots = torch.tensor([chunks[i].state for i in members])
            starts = [chunks[i].start == 0 for i in members]
            groups.append(
                (
                    upload(tokens, device),
                    upload(slots, device),
                    upload(torch.tensor(starts), device) if any(starts) else None,
                )
            )
        return groups

    def recur(self, layer: int, x: torch.Tensor, scan, fresh) -> torch.Tensor:
        """A recurrent layer's output for packed x [1, tokens, hidden]: scan(x, None, state) -> (y,
        state) per group of sequences with as many new tokens, each sequence's state read from and
        written back to its slot (a sequence's first chunk starts from fresh state). No token is
        padding. y may be of another width and dtype than x (the n-gram embedding's scan turns token
        digits into token ids)."""
        stored = self.cache.states[layer]
        out = None
        for tokens, slots, starts in self._scans:
            state = tuple(s[slots] for s in stored)
            if starts is not None:
                state = tuple(
                    torch.where(starts.view(-1, *[1] * (s.dim() - 1)), new.to(s.dtype), s)
                    for s, new in zip(state, fresh(len(slots)))
                )
            y, state = scan(x[0][tokens], None, state)
            for store, s in zip(stored, state):
                store[slots] = s.to(store.dtype)
            if out is None:
                out = y.new_empty((1, x.shape[1], *y.shape[2:]))
            out[0][tokens] = y
        return out

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
    ) -> torch.Tensor:
        """Store the packed tokens' keys and values [1, heads, tokens, width], then fn(q, keys,
        values, mask, key_positions) per group over its sequences' gathered keys (within `window`
        and the query's
        `chunk`);
        outputs packed [1, heads, tokens, width]. k and v None: attend `layer`'s stored keys and
        values (Gemma 3n's shared layers); `keep` needs nothing here, the cache holding every
        layer's."""
        if k is not None:
            self.cache.write(layer, self.slots, k, v)
        return self._each_group(layer, q, fn, window, chunk, (k if k is not None else q).dtype)

    def layer_input(self, layer: int) -> torch.Tensor:
        """`layer`'s own input of this step [1, tokens, width] (Gemma 3n, Gemma 4's E models)."""
        return self.per_layer_inputs[..., layer, :]

    def attend_again(self, layer: int, q: torch.Tensor, fn, fresh=None) -> torch.Tensor:
        """fn(q, keys, values, causal mask, key_positions) per group over the keys an earlier layer
        of this step stored in the cache (a looped model's first pass, model/loop_attention.py);
        outputs packed like attend's."""
        return self._each_group(layer, q, fn, None, None, q.dtype)

    def _each_group(
        self, layer: int, q, fn, window: int | None, chunk: int | None, dtype: torch.dtype
    ) -> torch.Tensor:
        # None unless --kernels triton (model/triton_attend.py); the default path pays one
        # comparison
        triton = triton_terms(fn, q) if select.chosen() == "triton" else None
        terms = self._in_place_terms(layer, q, fn, dtype) if triton is None else None
        scale, softcap = terms if terms is not None else (None, 0.0)
        outs = []
        for group in self.groups:
            if (
                triton is not None
                and (
                    y := attend_group(
                        group,
                        q,
                        self.cache.keys[layer],
                        self.cache.values[layer],
                        window,
                        chunk,
                        triton,
                    )
                )
                is not None
            ):
                outs.append(y)
                continue
            if scale is not None and group.query_pos.shape[1] == 1 and not group.prefix:
                # decodes: each sequence's keys read where its blocks hold them
                # (kernels/paged_decode.cpp)
                first, end = group.key_range(window, chunk)
                y = torch.ops.ster_kernels.paged_decode(
                    group.take(q)[:, :, 0],
                    self.cache.keys[layer],
                    self.cache.values[layer],
                    group.table,
                    first,
                    end,
                    scale,
                    softcap,
                )
                outs.append(y.unsqueeze(2))
                continue
            if (
                scale is not None
                and not group.prefix
                and chunk is None
                and causal_kernel_fits(q, self.cache.keys[layer], self.cache.values[layer])
            ):
                # a prompt's queries: each reads the keys before it where its blocks hold them, the
                # masked half
                # of the scores never computed (kernels/causal_attend.cpp)
                outs.append(
                    torch.ops.ster_kernels.causal_attend(
                        group.take(q),
                        self.cache.keys[layer],
                        self.cache.values[layer],
                        group.table,
                        group.starts,
                        window or 0,
                        scale,
                        softcap,
                    )
                )
                continue
            keys, values = self.cache.gather(layer, group.table)
            # a cache kept narrower than the model attends in the model's dtype
            if keys.dtype != dtype:
                keys, values = keys.to(dtype), values.to(dtype)
            outs.append(fn(group.take(q), keys, values, group.mask(window, chunk), group.key_pos))
        if len(self.groups) == 1:  # the whole step in one call: its output is already every token's
            return self.groups[0].packed(outs[0])
        out = outs[0].new_empty((1, outs[0].shape[1], self.total, outs[0].shape[3]))
        for group, y in zip(self.groups, outs):
            group.put(out, y)
        return out

    @functools.cached_property
    def key_reach(self) -> int:
        """One past the largest key position any attend call of this step sees (a group's gathered
        table, padding included, holds positions 0 .. its width in slots): StepState.key_reach, from
        the host."""
        return max(group.table.shape[1] for group in self.groups) * self.cache.block_size

    def decode_plan(
        self, scales: list[float], dtype: torch.dtype, ranges: tuple[list, list, list]
    ) -> tuple | None:
        """ster_kernels::push_plan's arguments where this step is decodes only, the cache in
        `dtype`: layer i
        planned where scales[i] > 0 (compiled.decode_plans), within its window and chunk and under
        its soft cap (`ranges`, compiled.decode_ranges); None otherwise."""
        if len(self.groups) != 1:
            return None
        group = self.groups[0]
        if group.query_pos.shape[1] != 1 or group.prefix or group.tokens != slice(0, self.total):
            return None
        keys, values = self.cache.keys, self.cache.values
        planned = planned_scales(scales, keys, dtype)
        if planned is None:
            return None
        first, end = group.key_range(None, None)
        bs = self.cache.block_size
        return (
            or_empty(keys),
            or_empty(values),
            planned,
            self.slots // bs,
            self.slots % bs,
            group.table,
            first,
            end,
            True,
            *ranges,
        )

    def _in_place_terms(self, layer: int, q, fn, dtype: torch.dtype) -> tuple[float, float] | None:
        """decode_kernel_terms with the cache in the model's dtype; None: gather and call fn."""
        keys = self.cache.keys[layer]
        if keys is None or keys.dtype != dtype or getattr(q, "dtype", None) != dtype:
            return None
        return decode_kernel_terms(fn, q, keys.dtype)

    def rotary(self, rope: RopeConfig, dtype: torch.dtype):
        key = (rope, dtype)
        if key not in self._rotary:
            # longrope picks its table by how far a sequence reaches: each chunk its own, as when
            # stepped
            # alone, not the furthest sequence's for all
            if (
                rope.rope_type == "longrope"
                and len({end > rope.original_max_position for end in self._ends}) > 1
            ):
                parts = [
                    self.tables.lookup(rope, self._positions[:, a:b], dtype)
                    for a, b in zip(self._offsets, self._offsets[1:])
                ]
                tables = tuple(torch.cat(tables, dim=1) for tables in zip(*parts))
            else:
                tables = self.tables.lookup(rope, self._positions, dtype)
            self._rotary[key] = tuple(upload(t, self.device) for t in tables)
        return self._rotary[key]
