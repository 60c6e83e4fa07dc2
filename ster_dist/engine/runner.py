"""The rank side of the token-level engine: this rank's paged KV cache, and one forward per step.

Every rank runs the same step on the same packed tokens and block tables (each holding its own
key-value heads, or the latent for latent attention, in blocks of the same ids; and, for recurrent
layers, its share of each running sequence's state in the slot the driver named); rank 0 alone
samples, since the logits are gathered on every rank, and sends back one token per sampling chunk.
With speculative decoding on, each rank also runs the model's MTP layer (engine/drafter.py) and rank
0 verifies its drafts (engine/rejection.py), sending back the drafts kept before that token. The
driver (engine/loop.py) decides everything else.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from ster_dist import kernels
from ster_dist.engine.drafter import MTPDrafter
from ster_dist.engine.modifiers import RowAdapters, RowSteering
from ster_dist.engine.rejection import rejection_sample, verify_greedy
from ster_dist.engine.sampling import Sampler
from ster_dist.engine.work import StepResult, StepWork
from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.kernels import select
from ster_dist.model.paged import Chunk, PagedCache
from ster_dist.parallel import packed
from ster_dist.parallel.linear import product_weights
from ster_dist.shard import arena
from ster_dist.load.mtp import load_mtp
from ster_dist.workers.extension import RankExtension


def available_memory(device: torch.device) -> int:
    """Bytes this rank could still allocate: free accelerator memory, else the host's
    MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


PACK_SHARE = 4  # --pack-weights auto: packed copies may take up to this share of the memory free


def pack_model(model, mode: str) -> list[torch.Tensor]:
    """Pack `model`'s projection weights (parallel/packed.py): "on", "off", or "auto" (where their
    packed copies take at most 1 / PACK_SHARE of the memory free now). Returns the weights
    packed."""
    if mode == "off" or not packed.available():
        return []
    weights = [w for w in product_weights(model) if packed.packable(w)]
    size = sum(packed.copy_bytes(w) for w in weights)
    if mode == "auto" and (not weights or size > available_memory(weights[0].device) // PACK_SHARE):
        return []
    pack_all(weights)
    return weights


def pack_all(weights: list[torch.Tensor]) -> None:
    """Pack each of `weights`; their panels lie in one block of memory in 2 MiB pages where the
    system allows (shard/arena.py: a decode step reads every weight once, and 4 KiB pages cost it
    13-16% there)."""
    laid = [w for w in weights if kernels.panels(w.dtype) and packed.lookup(w) is None]
    sizes = [packed.panel_bytes(w) for w in laid]
    offsets, end = [], 0
    for size in sizes:
        end = -(-end // arena.ALIGN) * arena.ALIGN
        offsets.append(end)
        end += size
    block = arena.Block(end) if laid else None
    for weight, at, size in zip(laid, offsets, sizes):
        packed.pack(weight, block.piece(at, size))
    for weight in weights:
        packed.pack(weight)  # the rest, for oneDNN (a weight packed already is left)


class ModelRunner(RankExtension):
    def __init__(self, rank):
        super().__init__(rank)
        self.cache: PagedCache | None = None
        self.sampler: Sampler | None = None
        self.steering: RowSteering | None = None
        self.adapters: RowAdapters | None = None
        self.step_s = 0.0
        self.steps = 0
        self.compile_after: int | None = None
        self.drafter: MTPDrafter | None = None
        self.mtp = None  # the model's MTP layer, loaded on first use and kept while the model is
        self.packed: list[torch.Tensor] = []  # weights this engine packed (released when it closes)

    def capacity(
        self, block_size: int, memory: int | None, fraction: float, cap: int | None = None
    ) -> dict:
        """What this rank's cache may take: `memory` bytes, else `fraction` of what is free now (at
        most `cap` bytes), and what one block and one sequence's recurrent state (0 without
        recurrent layers) cost here. The driver splits the budget between blocks and state slots
        (engine/loop.py cache_sizes)."""
        model = self.model
        budget = memory if memory is not None else int(fraction * available_memory(model.device))
        if cap is not None:
            budget = min(budget, cap)
        return {
            "budget": budget,
            "block_bytes": PagedCache.block_bytes(model, block_size),
            "state_bytes": PagedCache.state_bytes(model),
        }

    def select_kernels(self, choice: str | None) -> str:
        """Set the kernels this rank's layers run (kernels/select.py); refused where they cannot run
        here."""
        return select.choose(choice, self.model.device.type)

    def pack_weights(self, mode: str) -> int:
        """Pack this rank's projection weights (pack_model); returns the bytes packed."""
        self.packed = pack_model(self.model, mode)
        return sum(w.nbytes for w in self.packed)

    def draft_block_bytes(self, block_size: int) -> int:
        """What one block of the MTP layer's own cache costs on this rank (its keys use the
        decoder's block ids, so a block costs this more); loads the layer."""
        return PagedCache.block_bytes(self._draft(), block_size)

    def start(
        self,
        num_blocks: int,
        block_size: int,
        state_slots: int = 0,
        speculative: bool = False,
        compile_after: int | None = None,
    ) -> int:
        """Allocate the cache: the same block and state-slot counts on every rank (the driver's);
        with
        `speculative`, the MTP layer's too (engine/drafter.py). Layers are compiled once
        `compile_after` steps
        have run (None: never)."""
        model = self.model
        # the compiled step plans our CPU kernels' attention: Triton's stays eager
        if select.chosen() == "triton":
            compile_after = None
        self.steps, self.compile_after = 0, compile_after
        self.cache = PagedCache(model, num_blocks, block_size, state_slots=state_slots)
        self.drafter = (
            MTPDrafter(model, self._draft(), num_blocks, block_size) if speculative else None
        )
        self.sampler = Sampler() if self.rank.lead else None
        self.steering = self.steering or RowSteering(model)
        self.adapters = self.adapters or RowAdapters(model)
        return num_blocks

    @torch.inference_mode()
    def warm(self, max_tokens: int) -> int | None:
        """Compile the layers now and trace the graph of every token count a step may carry (1 to
        `max_tokens`),
        so no request meets a compile (seconds on a CPU) mid-stream, as vLLM captures its graphs at
        start-up. The steps run on zero tokens over a scratch cache of their own; the graphs do not
        depend on what a cache holds (attention is opaque to them). Returns the graphs made (None:
        steps stay eager)."""
        model = self.model
        if self.compile_after is None or model.compile_layers() is not None:
            return None
        made = model.compiled.graphs
        block = self.cache.block_size
        counts = warm_counts(max_tokens)
        scratch = PagedCache(model, 1 + -(-counts[-1] // block), block)
        for count in counts:
            blocks = tuple(range(1, 1 + -(-count // block)))  # block 0 is the null block
            model.forward_paged(
                torch.zeros(count, dtype=torch.long), [Chunk(blocks, 0, count)], scratch
            )
        self.compile_after = 0  # compiled: a step count never equals it
        return model.compiled.graphs - made

    def register_vector(self, key: str, vectors: list[tuple[int, torch.Tensor]]) -> None:
        self._started().steering.register(key, vectors)

    def register_adapter(self, name: str, sites: list[dict]) -> None:
        self._started().adapters.register(name, sites)

    def replace_adapter(self, name: str, sites: list[dict]) -> None:
        self._started().adapters.replace(name, sites)

    @torch.inference_mode()
    def step(self, work: StepWork) -> StepResult | None:
        start = time.perf_counter()
        try:
            return self._step(work)
        finally:
            self.step_s += time.perf_counter() - start

    def _step(self, work: StepWork) -> StepResult | None:
        self._started()
        if self.sampler is not None:
            for seq_id in work.removed:
                self.sampler.remove(seq_id)
            for new in work.added:
                self.sampler.add(new.id, new.params, new.prompt)
        if not work.chunks:
            return self.first_rank_only(StepResult([], []))
        self.steps += 1
        if self.steps == self.compile_after:
            self._compile()
        chunks = [
            Chunk(tuple(blocks), start, length, state, prefix)
            for blocks, start, length, state, prefix in work.chunks
        ]
        if self.drafter is not None:
            return self._speculative_step(work, chunks)
        self._modify_rows(work, chunks)
        try:
            # rows routed to their own adapters read a routing the compiled graphs would have to
            # guard on
            logits = self.model.forward_paged(
                torch.tensor(work.ids, dtype=torch.long),
                chunks,
                self.cache,
                eager=bool(self.adapters.attached),
            )
        finally:
            self.steering.clear()
            self.adapters.clear()
        if self.sampler is None:
            return None
        picked = [i for i, _ in work.samples]
        # every chunk samples in a step of decodes: their logits as they are, not copied row by row
        rows = logits if picked == list(range(logits.shape[0])) else logits[picked]
        tokens, logprobs = self.sampler.sample(rows, [seq_id for _, seq_id in work.samples])
        scores = {}
        for n, (row, seq_id) in enumerate(work.samples):
            ids = self.sampler.params(seq_id).logits_of
            # the raw logits, before any sampling setting; float64 so the driver reduces them in
            # double
            if ids:
                scores[n] = logits[row, list(ids)].double().tolist()
        return StepResult(tokens.tolist(), logprobs, scores)

    def _compile(self) -> None:
        reason = self.model.compile_layers()
        if self.rank.lead:
            progress(
                f"steps stay eager: {reason}"
                if reason
                else f"compiling the layers after {self.steps} steps (--enforce-eager keeps every step eager)"
            )

    def _modify_rows(self, work: StepWork, chunks: list[Chunk]) -> None:
        """Point steering vectors and adapters at the packed rows of the chunks that carry them."""
        if work.steering or work.adapters:  # most steps carry neither: no row bookkeeping for them
            rows = _chunk_rows(chunks)
            self.steering.set_rows(
                _group(rows, [((key, strength), i) for i, key, strength in work.steering])
            )
            self.adapters.set_rows(_group(rows, [(name, i) for i, name in work.adapters]))

    def _speculative_step(self, work: StepWork, chunks: list[Chunk]) -> StepResult | None:
        """A step whose decodes carry the MTP layer's drafts: proposed here (every rank alike), fed
        after each decode's token, verified on rank 0 against the logits of every drafted row
        (engine/rejection.py)."""
        drafter = self.drafter
        drafter.forget(work.removed)
        starts = [0]
        for chunk in chunks:
            starts.append(starts[-1] + chunk.length)
        proposed = drafter.propose(
            work.seq_ids, chunks, [work.ids[a] for a in starts[:-1]], dict(work.drafts)
        )
        ids, grown = [], []
        for i, chunk in enumerate(chunks):
            extra = proposed.get(i, [])
            ids += work.ids[starts[i] : starts[i + 1]] + extra
            grown.append(dataclasses.replace(chunk, length=chunk.length + len(extra)))
        ends = torch.tensor([c.length for c in grown]).cumsum(0)
        # sampling chunk -> its packed rows read (one, or each draft's and one more)
        rows: dict[int, list[int]] = {}
        for i, _ in work.samples:
            end = int(ends[i])
            rows[i] = list(range(end - len(proposed.get(i, ())) - 1, end))
        picked = [r for i, _ in work.samples for r in rows[i]]
        # a chunk's drafts are its rows too: steered and adapted as its own token
        self._modify_rows(work, grown)
        try:
            logits, hidden = self.model.forward_paged_rows(
                torch.tensor(ids, dtype=torch.long),
                grown,
                self.cache,
                torch.tensor(picked, dtype=torch.long),
                eager=bool(self.adapters.attached),
            )
        finally:
            self.steering.clear()
            self.adapters.clear()
        drafter.keep(work.seq_ids, grown, ids, hidden)
        if self.sampler is None:
            return None
        return self._verify(work, proposed, rows, logits)

    def _verify(
        self,
        work: StepWork,
        proposed: dict[int, list[int]],
        rows: dict[int, list[int]],
        logits: torch.Tensor,
    ) -> StepResult:
        """Rank 0: plain samples drawn as in any step; drafted ones verified."""
        at, offset = {}, 0
        for i, _ in work.samples:
            at[i] = slice(offset, offset + len(rows[i]))
            offset += len(rows[i])
        plain = [(n, i, seq_id) for n, (i, seq_id) in enumerate(work.samples) if i not in proposed]
        tokens: list = [None] * len(work.samples)
        logprobs: list = [None] * len(work.samples)
        scores, drafted, accepted = {}, {}, {}
        if plain:
            last = logits[[at[i].stop - 1 for _, i, _ in plain]]
            chosen, chosen_logprobs = self.sampler.sample(last, [seq_id for _, _, seq_id in plain])
            for row, (n, i, seq_id) in enumerate(plain):
                tokens[n], logprobs[n] = int(chosen[row]), chosen_logprobs[row]
                ids = self.sampler.params(seq_id).logits_of
                if ids:
                    scores[n] = last[row, list(ids)].double().tolist()
        for n, (i, seq_id) in enumerate(work.samples):
            if i not in proposed:
                continue
            drafts, block = proposed[i], logits[at[i]]
            if self.sampler.params(seq_id).greedy:
                out, _ = verify_greedy(block, drafts)
            else:
                out, _ = rejection_sample(
                    self.sampler.target_probs(block, seq_id),
                    drafts,
                    None,
                    self.sampler.generator(seq_id, block.device),
                )
            tokens[n], accepted[n], drafted[n] = out[-1], out[:-1], len(drafts)
        return StepResult(tokens, logprobs, scores, drafted, accepted)

    def _draft(self):
        # loaded again for a newly loaded model
        if self.mtp is None or self.mtp[0] is not self.rank.loaded:
            self.mtp = (self.rank.loaded, load_mtp(self.rank.loaded, self.rank.ctx()))
        return self.mtp[1]

    def timings(self) -> dict:
        """Seconds this rank spent in steps, and of those waiting for the previous pipeline
        stage."""
        return {"rank": self.rank.rank, "step_s": self.step_s, "wait_s": self.model.stage_wait_s}

    def stop(self) -> None:
        """Drop the cache and every registration (the group stays loaded)."""
        self.close()

    def _started(self) -> ModelRunner:
        if self.cache is None:
            raise Refusal(f"the engine runner on rank {self.rank.rank} was used before start()")
        return self

    def close(self) -> None:
        packed.release(self.packed)
        self.packed = []
        if self.steering is not None:
            self.steering.close()
        if self.adapters is not None:
            self.adapters.close()
        self.cache = self.sampler = self.steering = self.adapters = self.drafter = None


WARM_MOST = 256  # tokens of the longest warm-up step: its scratch cache and activations stay small


def warm_counts(max_tokens: int) -> list[int]:
    """Token counts whose steps trace every graph a step of 1 to `max_tokens` tokens runs: one token
    (the whole stack in one graph), then both ends of each range the traced code branches at
    (dense()'s kernels by row count, parallel/linear.py: 2-8, 9-15, 16-64, more, and 2-3 and 4 up
    where weights are packed; model/compiled.py), each range one dynamic graph, whose last is
    open-ended: past WARM_MOST tokens nothing is traced that a shorter step did not."""
    ends = {1, 2, 3, 4, 8, 9, 15, 16, 64, 65, min(max_tokens, WARM_MOST)}
    return sorted(c for c in ends if c <= max_tokens)


def _chunk_rows(chunks: list[Chunk]) -> list[torch.Tensor]:
    """The packed token rows of each chunk."""
    rows, start = [], 0
    for chunk in chunks:
        rows.append(torch.arange(start, start + chunk.length))
        start += chunk.length
    return rows


def _group(rows: list[torch.Tensor], keyed: list[tuple[object, int]]) -> dict:
    """key -> the packed rows of every chunk carrying it."""
    by_key: dict = {}
    for key, chunk in keyed:
        by_key.setdefault(key, []).append(rows[chunk])
    return {key: torch.cat(parts) for key, parts in by_key.items()}
