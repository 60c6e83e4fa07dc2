"""The step scheduler: which sequences run in the next forward pass, and which tokens of each.

A step is one forward pass over a flat batch of chunks; a chunk is a run of one sequence's tokens
whose k/v are not in the cache yet (a whole prompt, a slice of a long one, or the one token a decode
feeds). Prefill and decode mix freely in a step (vLLM v1's view: every sequence just has tokens to
catch up on).

Policy, each schedule():
  1. Running sequences first, in arrival order, so a decode is never starved by new prompts. Each
     gets min(tokens not yet computed, budget left, max_prefill_chunk): one token for a decode, the
     next slice for a prompt still being prefilled. Its block table is first trimmed to the sliding
     window (when the model has one), then grown to cover the chunk. When the pool cannot supply the
     blocks, the most recently arrived running sequence is preempted by recompute: its blocks go
     back, computed drops to 0 and it returns to the FRONT of the waiting queue, to be prefilled
     again (prompt and output so far; prefix caching usually makes that cheap, its full blocks
     having stayed cached). Repeat until the blocks come or the victim is the sequence itself (then
     it waits).
  2. Then waiting sequences, in arrival order, while budget and max_running allow: look up the
     prefix cache (computed = matched blocks x block size), allocate the chunk's blocks, schedule
     min(remaining, budget left, max_prefill_chunk) tokens. Admission stops at the first sequence
     that does not fit (strict FIFO: a big prompt is not overtaken forever by small ones). A
     sequence that could never fit, even alone in the pool, is refused by add() (see fits_ever).
     Under whole_prompt (a prefix LM, whose prompt attends both ways within itself) a sequence is
     admitted only when its first chunk can hold its whole prompt, and a prompt longer than a chunk
     is refused by add().
  3. A chunk samples when it ends at the sequence's last known token: its last logits give the next
     token. A prompt's earlier slices do not sample.

The engine loop around this: plan = schedule(); run the chunks; after_step(plan) (marks k/v
computed, registers full blocks in the prefix cache); for each sampling chunk, append(seq, token),
then finish(seq) when it is done (eos, stop string, max_tokens). Nothing here decides when a
sequence ends. Plans in flight together (one per pipeline stage) carry disjoint sequences:
schedule(busy) skips, and never preempts, a sequence a plan in flight carries; each plan's
after_step comes before its sequences are scheduled again. A sequence finished or aborted while its
step ran is skipped by after_step.

Speculative decoding (engine/drafter.py): a running sequence one token behind (a decode) whose
`drafts` is set
gets a chunk that may carry that many draft tokens after its own: its blocks cover them and the
budget counts them, but only its own token counts as computed after the step; each draft the ranks
verified joins through accept_draft (its k/v already written), and the keys of refused drafts lie
past `computed`, to be overwritten. The MTP layer's own keys run a step behind: after each step a
drafting sequence's blocks before its chunk's start have them all written and are marked so in the
pool (with the token after each), and a drafting sequence admitted shares only the leading matched
blocks so marked for its own next tokens (BlockPool.drafted_prefix), recomputing the rest, so its
MTP cache is a cold run's.

Sliding window: blocks wholly before (chunk start - window) are released and their table entries
become NULL_BLOCK; the ranks must mask those positions (they are outside the window anyway).
Prefix matching still walks from the first block, so a long windowed sequence whose head blocks
were evicted gets no hit; fine for now, vLLM's right-to-left window matching would lift that.

Block bookkeeping: a sequence holds one pool reference per non-null entry of its block table, and
nothing else holds any (the prefix cache holds no references, it only remembers released blocks).
A waiting or finished sequence holds no blocks.

Recurrent state (a model with Mamba, gated delta or short-convolution layers): each running sequence
also holds a state slot (engine/state_slots.py), taken at admission and given back with its blocks
(finish, abort, preemption). There are as many slots as running sequences allowed, so admission
never waits on one. Such a model runs without prefix caching: a cached prefix's blocks hold its
keys, not the state its recurrent layers reached, so a sequence always starts at position 0, and a
preempted one is recomputed from there on fresh state.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass, field

from ster_dist.engine.blocks import NULL_BLOCK, BlockHashes, BlockPool
from ster_dist.engine.state_slots import StateSlots


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and its place in the cache. Identity is the object (eq=False): two
    sequences with the same tokens are still two."""

    id: str
    tokens: list[int]  # prompt then output so far
    prompt_len: int
    max_tokens: int  # new tokens allowed
    # what else its k/v depend on (adapter, steering); "" shares with plain prompts
    cache_salt: str = ""
    # block table; NULL_BLOCK where a window released one
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens whose k/v are in the cache
    status: Status = Status.WAITING
    arrival: int = -1  # order of add(), set by the scheduler
    preemptions: int = 0
    cached: int = 0  # tokens served from the prefix cache, over all admissions
    # its recurrent-state slot while running (-1: none, or the model keeps no state)
    state: int = -1
    # speculative decoding: most draft tokens a decode of it may carry (0: none)
    drafts: int = 0
    # scheduler-private: digests of full blocks, and how far the table is registered /
    # window-trimmed
    hashes: BlockHashes | None = field(default=None, repr=False)
    registered_blocks: int = field(default=0, repr=False)
    released_blocks: int = field(default=0, repr=False)
    # leading blocks with every MTP key written (drafts > 0)
    drafted_blocks: int = field(default=0, repr=False)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.computed


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position fed (== seq.computed when scheduled)
    length: int
    samples: bool  # ends at the sequence's last known token: its logits give the next token
    # draft tokens the ranks may feed after a decode's token (blocks cover them; budget counts them)
    drafts: int = 0


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.length + c.drafts for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_step_tokens: int = 512,
        max_running: int = 256,
        window: int | None = None,
        max_prefill_chunk: int | None = None,
        state_slots: int = 0,
        whole_prompt: bool = False,
    ):
        """window: set only when EVERY layer attends over at most `window` keys; blocks wholly
        before the window of a sequence's next position are then released. max_prefill_chunk caps
        one chunk's tokens (default: the step budget). max_running is held to max_step_tokens: more
        running sequences than the budget has tokens could not all decode in one step, and the
        latest would wait on the earliest holding their blocks. state_slots: the model's recurrent
        layers keep this many sequences' states (0: it has none); max_running is held to it too."""
        if max_step_tokens < 1 or max_running < 1:
            raise ValueError("max_step_tokens and max_running must be positive")
        if max_prefill_chunk is not None and max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be positive, got {max_prefill_chunk}")
        if window is not None and window < 1:
            raise ValueError(f"window must be positive, got {window}")
        if whole_prompt and pool.prefix_caching:
            raise ValueError(
                "a prompt read whole cannot share prefixes: its first blocks' keys depend on the "
                "tokens after them; make the pool without prefix caching"
            )
        # each sequence's first chunk reads its whole prompt (a prefix LM's, attending both ways
        # within itself)
        self.whole_prompt = whole_prompt
        if state_slots and pool.prefix_caching:
            raise ValueError(
                "a model with recurrent state cannot share prefixes: a cached block holds keys, "
                "not the state its sequence reached; make the pool without prefix caching"
            )
        self.pool = pool
        self.block_size = pool.block_size
        self.max_step_tokens = max_step_tokens
        self.max_running = min(max_running, max_step_tokens, state_slots or max_running)
        self.slots = StateSlots(state_slots) if state_slots else None
        self.window = window
        self.max_chunk = min(max_step_tokens, max_prefill_chunk or max_step_tokens)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # kept in arrival order: preemption takes from the end
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = 0
        self._preemptions = 0
        self._steps = 0

    # ---- reading

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def get(self, seq_id: str) -> Sequence | None:
        return self._by_id.get(seq_id)

    def stats(self) -> dict:
        return {
            "waiting": len(self._waiting),
            "running": len(self._running),
            "steps": self._steps,
            "preemptions": self._preemptions,
            "pool": self.pool.stats(),
            "state_slots": self.slots.count if self.slots is not None else 0,
        }

    def blocks_at_peak(self, n_tokens: int) -> int:
        """The most blocks one sequence of n_tokens (prompt + max_tokens) ever holds at once."""
        whole = _ceil_div(n_tokens, self.block_size)
        if self.window is None:
            return whole
        # kept: the window before a chunk's start (one block more for a start mid-block) and the
        # chunk
        return min(whole, _ceil_div(self.window + self.max_chunk, self.block_size) + 1)

    def fits_ever(self, n_tokens: int) -> bool:
        """Whether a sequence of n_tokens in all can run even alone in the pool; one that cannot
        would wait forever at the head of the queue and hold everyone behind it."""
        return self.blocks_at_peak(n_tokens) <= self.pool.usable_blocks

    # ---- the loop's calls

    def add(self, seq: Sequence) -> None:
        if seq.id in self._by_id:
            raise ValueError(f"sequence {seq.id!r} is already scheduled")
        if seq.status is not Status.WAITING or seq.blocks or seq.computed or seq.state >= 0:
            raise ValueError(f"sequence {seq.id!r} is not fresh")
        if not seq.tokens or not 0 < seq.prompt_len <= len(seq.tokens):
            raise ValueError(f"sequence {seq.id!r} needs a prompt of at least one token")
        if seq.max_tokens < 1:
            raise ValueError(f"sequence {seq.id!r} must allow at least one new token")
        if self.whole_prompt and seq.prompt_len > self.max_chunk:
            raise ValueError(
                f"sequence {seq.id!r}'s prompt of {seq.prompt_len} tokens is read whole, in one chunk, "
                f"but a chunk holds at most {self.max_chunk}"
            )
        if not self.fits_ever(seq.prompt_len + seq.max_tokens):
            raise ValueError(
                f"sequence {seq.id!r} ({seq.prompt_len} + {seq.max_tokens} tokens) can never "
                f"fit in {self.pool.usable_blocks} blocks of {self.block_size}"
            )
        seq.arrival = self._arrivals
        self._arrivals += 1
        seq.hashes = BlockHashes(self.block_size, seq.cache_salt)
        self._by_id[seq.id] = seq
        self._waiting.append(seq)

    def append(self, seq: Sequence, token: int) -> None:
        """A sampled token joins the sequence (after the step that sampled it)."""
        seq.tokens.append(token)

    def accept_draft(self, seq: Sequence, token: int) -> None:
        """A verified draft token joins the sequence with its k/v already in the cache (its step fed
        it)."""
        seq.tokens.append(token)
        seq.computed += 1
        self._register_full(seq)

    def finish(self, seq: Sequence) -> None:
        """The loop decided the sequence is done: its blocks go back now."""
        self._remove(seq)

    def abort(self, seq_id: str) -> Sequence | None:
        seq = self._by_id.get(seq_id)
        if seq is not None:
            self._remove(seq)
        return seq

    def schedule(self, busy: frozenset[str] = frozenset(), parts: int = 1) -> StepPlan:
        """The next step's chunks. `busy`: sequences a step still in flight carries (pipeline
        micro-batches): neither scheduled again nor preempted until that step is back. `parts`:
        micro-batches in flight at once; each step takes at most its share of the sequences, so the
        others fill the next one."""
        plan = StepPlan()
        budget = self.max_step_tokens
        cap = -(-(len(self._running) + len(self._waiting)) // parts)
        self._schedule_running(plan, budget, busy, cap)
        budget -= plan.num_tokens
        self._admit_waiting(plan, budget, cap)
        if not plan.is_empty:
            self._steps += 1
        return plan

    def after_step(self, plan: StepPlan) -> None:
        """The step ran: its chunks' k/v are in the cache; their full blocks join the prefix
        cache."""
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is not Status.RUNNING:  # finished or aborted while the step ran
                continue
            if seq.computed != chunk.start:
                raise ValueError(
                    f"sequence {seq.id!r}: chunk at {chunk.start} but {seq.computed} computed"
                )
            seq.computed += chunk.length
            self._register_full(seq)
            # the ranks wrote the MTP keys of every position before this chunk's start this step
            if seq.drafts:
                self._mark_drafted(seq, chunk.start)

    def _register_full(self, seq: Sequence) -> None:
        full = seq.computed // self.block_size
        if full > seq.registered_blocks and self.pool.prefix_caching:
            digests = seq.hashes.extend(seq.tokens, full * self.block_size)
            self.pool.register(seq.blocks, digests, seq.registered_blocks, full)
            seq.registered_blocks = full

    def _mark_drafted(self, seq: Sequence, written: int) -> None:
        """Mark the sequence's blocks whose MTP keys are all written (positions below `written`)."""
        full = written // self.block_size
        if full > seq.drafted_blocks and self.pool.prefix_caching:
            for i in range(seq.drafted_blocks, full):
                self.pool.mark_drafted(seq.blocks[i], seq.tokens[(i + 1) * self.block_size])
            seq.drafted_blocks = full

    # ---- policy

    def _schedule_running(
        self, plan: StepPlan, budget: int, busy: frozenset[str], cap: int
    ) -> None:
        i = 0
        while i < len(self._running) and budget > 0 and len(plan.chunks) < cap:
            seq = self._running[i]
            length = min(seq.uncomputed, budget, self.max_chunk)
            if length <= 0 or seq.id in busy:  # its sampled token has not been appended yet
                i += 1
                continue
            start = seq.computed
            # a decode's drafts: no more than the budget holds, nor than its max_tokens could keep
            # past the token
            drafts = (
                max(0, min(seq.drafts, budget - length, seq.max_tokens - seq.num_generated - 1))
                if seq.drafts and seq.uncomputed == 1
                else 0
            )
            self._release_outside_window(seq, start)
            if drafts and not self._cover(seq, start + length + drafts):
                # drafts never preempt anyone: without blocks to spare the decode runs alone
                drafts = 0
            while not self._cover(seq, start + length):
                victim = next((s for s in reversed(self._running) if s.id not in busy), None)
                if victim is None:
                    return  # every other one is in flight: this one waits for their blocks
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it was the last one running: everyone after it is already preempted
            plan.chunks.append(
                ScheduledChunk(seq, start, length, start + length == len(seq.tokens), drafts)
            )
            budget -= length + drafts
            i += 1

    def _admit_waiting(self, plan: StepPlan, budget: int, cap: int) -> None:
        while (
            self._waiting
            and budget > 0
            and len(self._running) < self.max_running
            and len(plan.chunks) < cap
        ):
            seq = self._waiting[0]
            matched = self.pool.match_prefix(seq.tokens, seq.hashes, record=False)
            # it drafts: only blocks whose MTP keys are as its own would be (engine/blocks.py)
            if seq.drafts:
                kept = self.pool.drafted_prefix(matched, seq.tokens)
                self.pool.release(matched[kept:])
                matched = matched[:kept]
                seq.drafted_blocks = kept
            seq.blocks = matched
            seq.computed = len(matched) * self.block_size
            seq.registered_blocks = len(matched)
            length = min(seq.uncomputed, budget, self.max_chunk)
            start = seq.computed
            if self.whole_prompt and start + length < seq.prompt_len:
                self._drop_blocks(seq)  # its prompt waits for a step with room for all of it
                break
            self._release_outside_window(seq, start)
            if not self._cover(seq, start + length):
                self._drop_blocks(seq)  # it waits holding nothing; the lookup is retried next step
                break
            self.pool.record_query(len(seq.tokens), start)
            seq.cached += start
            self._waiting.popleft()
            seq.status = Status.RUNNING
            if self.slots is not None:
                seq.state = self.slots.take()
            self._insert_running(seq)
            plan.chunks.append(
                ScheduledChunk(seq, start, length, start + length == len(seq.tokens))
            )
            budget -= length

    def _cover(self, seq: Sequence, end: int) -> bool:
        """Grow the block table to hold positions [0, end); False (table unchanged) if the pool is
        short."""
        missing = _ceil_div(end, self.block_size) - len(seq.blocks)
        if missing <= 0:
            return True
        got = self.pool.allocate(missing)
        if got is None:
            return False
        seq.blocks.extend(got)
        return True

    def _release_outside_window(self, seq: Sequence, start: int) -> None:
        """Release the blocks no query from `start` on can attend to. Kept: every key at or after
        start - window, one more than a window counting the query itself needs, so either convention
        of "window" is safe."""
        if self.window is None:
            return
        first_kept = max(0, start - self.window) // self.block_size
        first_kept = min(first_kept, len(seq.blocks))
        if first_kept <= seq.released_blocks:
            return
        gone = seq.blocks[seq.released_blocks : first_kept]
        seq.blocks[seq.released_blocks : first_kept] = [NULL_BLOCK] * len(gone)
        seq.released_blocks = first_kept
        self.pool.release(gone)

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self._drop_blocks(seq)
        self._drop_state(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.computed = 0
        seq.registered_blocks = 0
        seq.released_blocks = 0
        seq.drafted_blocks = 0

    def _drop_state(self, seq: Sequence) -> None:
        if seq.state >= 0:
            self.slots.give_back(seq.state)
            seq.state = -1

    def _insert_running(self, seq: Sequence) -> None:
        bisect.insort(self._running, seq, key=lambda s: s.arrival)

    def _remove(self, seq: Sequence) -> None:
        if self._by_id.get(seq.id) is not seq:
            raise ValueError(f"sequence {seq.id!r} is not scheduled here")
        if seq.status is Status.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._drop_blocks(seq)
        self._drop_state(seq)
        seq.status = Status.FINISHED
        del self._by_id[seq.id]
