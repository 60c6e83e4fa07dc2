"""The token-level engine: continuous batching over a worker group, on the driver.

One thread owns the group. Every step it takes new requests and cancellations, lets the scheduler
pick the step's chunks (decodes first, then chunked prefills under a token budget; preemption by
recompute when blocks run out), runs one forward on every rank (engine/runner.py), and hands each
sampled token to its request: detokenized incrementally, checked against end-of-sequence, stop
tokens, stop strings and max_tokens, streamed out, and retired at once (its blocks freed) when done.
With speculative_tokens set, each decode carries up to that many drafts of the model's MTP layer,
verified on the ranks in the same forward (engine/drafter.py, engine/rejection.py); every verified
one is handed on as a sampled token. A model with recurrent layers also keeps a state slot per
running request (cache_sizes counts them against the cache budget) and runs without prefix caching
(engine/scheduler.py says why).

    engine = TokenEngine(group, cfg, tokenizer, eos, EngineConfig())
    stream = engine.submit(prompt_ids, SamplingParams(max_tokens=64))
    for delta in stream: print(delta.text, end="")
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field

from ster_dist.engine.blocks import BlockPool
from ster_dist.engine.detok import Detokenizer
from ster_dist.engine.client import RunnerClient
from ster_dist.engine.omp_pool import release_idle_workers
from ster_dist.engine.sampling import SamplingParams
from ster_dist.engine.scheduler import Scheduler, Sequence
from ster_dist.engine.stream import Delta, RequestStream
from ster_dist.engine.work import NewSequence, StepWork
from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.workers.worker_group import WorkerGroup


DEFAULT_KV_CAP = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    # bytes of KV blocks per rank; None: kv_cache_fraction of free memory,
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.1  # at most DEFAULT_KV_CAP (a server gives its own figure)
    block_size: int = 16
    max_step_tokens: int = 512  # tokens one forward may carry (decodes + prefill chunks)
    max_running: int = 256
    # switched off for models with recurrent layers whatever this says
    prefix_caching: bool = True
    # a cap on the pool (tests use tiny ones to force preemption)
    max_blocks: int | None = None
    # steps in flight at once, on disjoint requests: one per pipeline stage
    micro_batches: int = 1
    # MTP drafts per decode (engine/drafter.py); 0: no speculative decoding
    speculative_tokens: int = 0
    # the ranks' projection weights packed beside the plain ones (parallel/packed.py): "auto" where
    # the copies take at most a quarter of the memory free, "on", "off"
    pack_weights: str = "auto"
    # steps run before the ranks compile their layers (model/compiled.py): a run that long will earn
    # back the
    # seconds compiling takes on a CPU, a short one would not; None: every step eager
    # (--enforce-eager)
    compile_after: int | None = None
    # --kernels (kernels/select.py); None: the ranks' device's default
    kernels: str | None = None


COMPILE_AFTER = 128  # what a session's engine takes unless --enforce-eager


def cache_sizes(sizes: list[dict], config: EngineConfig, max_position: int) -> tuple[int, int]:
    """(KV blocks, recurrent-state slots) every rank can hold, from each rank's capacity
    (engine/runner.py).

    Recurrent states come out of the same per-rank budget as the blocks (kv_cache_memory or
    kv_cache_fraction): a model with recurrent layers gets a slot per request it may run at once
    (max_running, held to max_step_tokens), fewer where those would take more than half a rank's
    budget; the rest is blocks. Never more blocks than every running request could fill at the
    model's full context (plus the null block): a model whose layers are all recurrent keeps no
    keys, and its blocks cost nothing."""
    slots = 0
    with_state = [s for s in sizes if s["state_bytes"]]
    if with_state:
        slots = min(
            config.max_running,
            config.max_step_tokens,
            *(s["budget"] // 2 // s["state_bytes"] for s in with_state),
        )
        if slots < 1:
            worst = min(with_state, key=lambda s: s["budget"] // s["state_bytes"])
            raise Refusal(
                f"one sequence's recurrent state takes {worst['state_bytes']} bytes, more than half the "
                f"{worst['budget']}-byte cache budget; give --kv-cache-memory more bytes"
            )
    blocks = -(-max_position // config.block_size) * (slots or config.max_running) + 1
    for s in sizes:
        if s["block_bytes"]:
            blocks = min(blocks, (s["budget"] - slots * s["state_bytes"]) // s["block_bytes"])
    if config.max_blocks is not None:
        blocks = min(blocks, config.max_blocks)
    if blocks < 2:
        raise Refusal(
            f"the KV cache budget holds {blocks} blocks of {config.block_size} tokens "
            f"({sizes[0]['block_bytes']} bytes each); give --kv-cache-memory more bytes"
        )
    return blocks, slots


def check_speculative(cfg, config: EngineConfig) -> None:
    """Refuse, in one line, speculative decoding where it cannot run: no MTP layer to draft with, a
    pipeline, a step too small for drafts (recurrent state, which cannot roll back past a refused
    draft, is refused once the ranks have measured it)."""
    if not cfg.mtp_layers:
        raise Refusal(
            "--speculative mtp drafts with the model's multi-token-prediction layers and this config "
            "states none (num_nextn_predict_layers); drop --speculative"
        )
    if cfg.mtp_layers != 1:
        raise Refusal(
            f"--speculative mtp drafts with exactly one MTP layer (DeepSeek-V3's) and this config states "
            f"{cfg.mtp_layers}; drop --speculative"
        )
    if config.micro_batches > 1:
        raise Refusal("--speculative mtp runs on one pipeline stage; drop --pp or --speculative")
    if config.speculative_tokens > config.max_step_tokens // 2:
        raise Refusal(
            f"--num-speculative-tokens {config.speculative_tokens} leaves a {config.max_step_tokens}-token "
            "step room for too few decodes; give fewer drafts or more --max-step-tokens"
        )


def drafts_apply(params: SamplingParams) -> bool:
    """Whether a request's decodes carry drafts: not where rank 0 reads more than the chosen token's
    distribution (penalties count each token as drawn; logprobs and logits_of report every
    position)."""
    return not params.penalized and params.logprobs is None and not params.logits_of


@dataclass
class _Live:
    """A request in flight: its sequence, stream, settings and detokenizer."""

    seq: Sequence
    stream: RequestStream
    params: SamplingParams
    detok: Detokenizer
    steering: tuple[str, float] | None
    adapter: str | None
    sent: bool = False  # the ranks know it (its sampler state exists on rank 0)
    logprobs: list = field(default_factory=list)


def _start_ranks(
    runners: RunnerClient, cfg, config: EngineConfig, speculative: bool
) -> tuple[list[dict], int, int]:
    """Pack the ranks' weights, size their caches and allocate them: (each rank's sizes, blocks,
    state slots)."""
    # first: `torch` keeps our CPU kernels (and packing for them) off
    runners.select_kernels(config.kernels)
    # before the cache's share of the memory free
    packed = max(runners.pack_weights(config.pack_weights))
    if packed:
        size = f"{packed / 2**20:.0f} MiB" if packed >= 2**20 else f"{packed / 2**10:.0f} KiB"
        progress(
            f"packed {size} of weights per rank for the CPU's products (--pack-weights off keeps one copy)"
        )
    sizes = runners.capacity(
        config.block_size,
        config.kv_cache_memory,
        config.kv_cache_fraction,
        DEFAULT_KV_CAP if config.kv_cache_memory is None else None,
    )
    if speculative:
        if any(s["state_bytes"] for s in sizes):
            raise Refusal(
                "--speculative mtp cannot run on a model with recurrent layers: their state cannot "
                "roll back past a refused draft; drop --speculative"
            )
        # the MTP layer's keys sit in blocks of the same ids: a block costs that much more on each
        # rank
        for size, extra in zip(sizes, runners.draft_block_bytes(config.block_size)):
            size["block_bytes"] += extra
    blocks, slots = cache_sizes(sizes, config, cfg.max_position)
    runners.start(blocks, config.block_size, slots, speculative, config.compile_after)
    return sizes, blocks, slots


class TokenEngine:
    def __init__(
        self,
        group: WorkerGroup,
        cfg,
        tokenizer,
        eos: tuple[int, ...],
        config: EngineConfig = EngineConfig(),
    ):
        self.group, self.cfg, self.tokenizer, self.eos = group, cfg, tokenizer, tuple(eos)
        self.config = config
        speculative = config.speculative_tokens > 0
        if speculative:
            check_speculative(cfg, config)
        self.runners = runners = RunnerClient(group)
        try:
            sizes, blocks, slots = _start_ranks(runners, cfg, config, speculative)
        except BaseException:
            with contextlib.suppress(Exception):  # a group already gone keeps the first error
                runners.stop()  # what a rank packed or allocated before the refusal goes with it
            raise
        self.block_bytes = sizes[0]["block_bytes"]
        self.state_bytes = sizes[0]["state_bytes"]
        # a shared prefix's blocks hold its keys, not the recurrent state it left: no sharing with
        # state; nor
        # where a prompt attends both ways, its first blocks' keys then depending on the tokens
        # after them
        self.pool = BlockPool(
            blocks,
            config.block_size,
            config.prefix_caching and not slots and not cfg.bidirectional_prompt,
        )
        windows = set(cfg.layer_window)
        window = windows.pop() if len(windows) == 1 and None not in windows else None
        self.scheduler = Scheduler(
            self.pool,
            config.max_step_tokens,
            config.max_running,
            window=window,
            state_slots=slots,
            whole_prompt=cfg.bidirectional_prompt,
        )
        self._live: dict[str, _Live] = {}
        self._inbox: list[_Live] = []
        self._cancels: list[str] = []
        self._removed: list[str] = []
        self._vectors: set[str] = set()
        self._adapters: set[str] = set()
        self._versions: dict[str, int] = {}  # adapter -> how often its factors were replaced
        self._ids = itertools.count()
        self._cond = threading.Condition()
        # one call on the ranks at a time: steps and registrations
        self._group_lock = threading.Lock()
        self._closing = False
        self._error: BaseException | None = None
        self.counters = {
            "requests": 0,
            "finished": 0,
            "aborted": 0,
            "steps": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "preemptions": 0,
            "overlapped_steps": 0,
            "drafted_tokens": 0,
            "accepted_tokens": 0,
            "rejected_tokens": 0,
        }
        # this thread's OpenMP workers (from loading the model here) would slow every step the
        # engine's thread
        # runs (engine/omp_pool.py); released, they come back if this thread computes again
        release_idle_workers()
        self._thread = threading.Thread(target=self._run, name="ster-token-engine", daemon=True)
        self._thread.start()

    # -- requests ---------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile the layers now, each step size's graph included, rather than once COMPILE_AFTER
        steps have run and each size at its first step (model/compiled.py): a server pays it before
        it says it is ready. Nothing without compiled steps (--enforce-eager, an eager model)."""
        if self.config.compile_after is None:
            return
        started = time.perf_counter()
        with self._from_outside():
            made = self.runners.warm(self.config.max_step_tokens)
        if made is not None:
            progress(
                f"warmed the compiled steps for 1 to {self.config.max_step_tokens} tokens in "
                f"{time.perf_counter() - started:.1f} s ({made} new graphs)"
            )

    def add_vector(self, key: str, vectors) -> None:
        """Register a steering vector ([(layer, tensor)]) under `key` on every rank, once."""
        with self._from_outside():
            if key not in self._vectors:
                self.runners.register_vector(key, vectors)
                self._vectors.add(key)

    def add_adapter(self, name: str, sites: list[dict]) -> None:
        """Register a LoRA adapter's global factors per projection under `name` on every rank,
        once."""
        with self._from_outside():
            if name not in self._adapters:
                self.runners.register_adapter(name, sites)
                self._adapters.add(name)

    def replace_adapter(self, name: str, sites: list[dict]) -> None:
        """New factors for the adapter registered under `name` (the same projections), copied in on
        every rank between two steps; a request already running continues under them. A trainer
        calls this after each optimizer step; the base is not reloaded."""
        with self._from_outside():
            if name not in self._adapters:
                raise Refusal(f"adapter {name!r} is not registered with the engine")
            self.runners.replace_adapter(name, sites)
            self._versions[name] = self._versions.get(name, 0) + 1

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams = SamplingParams(),
        *,
        steering: tuple[str, float] | None = None,
        adapter: str | None = None,
        request_id: str | None = None,
        on_finish=None,
    ) -> RequestStream:
        """Queue one request; returns its stream at once. Refused here, before it is queued: an
        empty prompt, one past the model's positions, or one the whole cache could never hold.
        `on_finish(stream)`
        is called from the engine's thread once the stream's last delta is in."""
        self.check(prompt_ids, params, steering=steering, adapter=adapter)
        request_id = request_id or f"r{next(self._ids)}"
        stream = RequestStream(request_id, len(prompt_ids), self.cancel, on_finish)
        if params.max_tokens == 0:  # nothing to generate: done before it starts
            stream.put(Delta("", [], "length"))
            return stream
        # steered or adapted keys differ from plain ones: the prefix cache keeps them apart
        salt = repr((steering, adapter)) if steering is not None or adapter is not None else ""
        # replaced factors: the blocks cached under the old ones are not these
        if self._versions.get(adapter):
            salt += f"#{self._versions[adapter]}"
        seq = Sequence(
            request_id,
            list(prompt_ids),
            len(prompt_ids),
            params.max_tokens,
            cache_salt=salt,
            drafts=self.config.speculative_tokens if drafts_apply(params) else 0,
        )
        detok = Detokenizer(self.tokenizer, list(prompt_ids), params.stop)
        live = _Live(seq, stream, params, detok, steering, adapter)
        with self._cond:
            if self._error is not None or self._closing:
                raise Refusal(f"the engine has stopped: {self._error or 'closed'}")
            self._inbox.append(live)
            self._cond.notify_all()
        return stream

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._cancels.append(request_id)
            self._cond.notify_all()

    def check(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        steering: tuple[str, float] | None = None,
        adapter: str | None = None,
    ) -> None:
        """What `submit` refuses, without queueing anything: a caller that submits later (the
        server, once its answer is set up) refuses bad requests first."""
        params.check()
        self._check(prompt_ids, params)
        if steering is not None and steering[0] not in self._vectors:
            raise Refusal(f"steering vector {steering[0]!r} is not registered with the engine")
        if adapter is not None and adapter not in self._adapters:
            raise Refusal(f"adapter {adapter!r} is not registered with the engine")

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        limit = self.cfg.max_position
        if not prompt_ids:
            raise Refusal(
                "a prompt encodes to no tokens; give it some text or turn the chat template on"
            )
        if len(prompt_ids) > limit:
            raise Refusal(
                f"a prompt encodes to {len(prompt_ids)} tokens, more than the model's {limit} positions; "
                "shorten it"
            )
        if len(prompt_ids) + params.max_tokens > limit:
            raise Refusal(
                f"max_tokens {params.max_tokens} past a {len(prompt_ids)}-token prompt runs beyond the "
                f"model's {limit} positions; give at most {limit - len(prompt_ids)}"
            )
        vocab = self.cfg.vocab_size
        if any(i >= vocab for i in params.logits_of):
            raise Refusal(
                f"logits_of asks for token id {max(params.logits_of)}, past this model's {vocab}-token "
                "vocabulary"
            )
        if self.scheduler.whole_prompt and len(prompt_ids) > self.scheduler.max_chunk:
            raise Refusal(
                f"a {len(prompt_ids)}-token prompt attends both ways (prefix_lm) and is read in one step, "
                f"which holds at most {self.scheduler.max_chunk} tokens; give --max-step-tokens more "
                "or shorten the prompt"
            )
        if not self.scheduler.fits_ever(len(prompt_ids) + params.max_tokens):
            raise Refusal(
                f"a {len(prompt_ids)}-token prompt with max_tokens {params.max_tokens} needs more KV blocks "
                f"than the whole cache holds ({self.pool.stats()['total']} of {self.config.block_size} "
                "tokens); give --kv-cache-memory more bytes or ask for fewer tokens"
            )

    # -- state ------------------------------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        """A step failed (a rank died, memory ran out) and the engine took no more requests."""
        return self._error is not None

    @property
    def idle(self) -> bool:
        with self._cond:
            return not (self._inbox or self._live)

    def stats(self) -> dict:
        with self._cond:
            drafted = self.counters["drafted_tokens"]
            return {
                **self.counters,
                "acceptance_rate": self.counters["accepted_tokens"] / drafted if drafted else 0.0,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting) + len(self._inbox),
                "kv_blocks": self.pool.stats(),
                "block_bytes": self.block_bytes,
                "prefix_caching": self.pool.prefix_caching,
                "state_slots": self.scheduler.stats()["state_slots"],
                "state_bytes": self.state_bytes,
            }

    @contextlib.contextmanager
    def paused(self):
        """No step runs inside the block (another operation has the ranks); requests keep
        queueing."""
        with self._from_outside():
            yield

    @contextlib.contextmanager
    def _from_outside(self):
        """The ranks for another thread than the engine's: one call at a time, and after it that
        thread's OpenMP workers, which work on in-process ranks makes, released
        (engine/omp_pool.py)."""
        with self._group_lock:
            try:
                yield
            finally:
                release_idle_workers()

    def close(self) -> None:
        """Finish nothing more: every request still in flight ends with "abort"; the ranks drop the
        cache."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        with self._group_lock:
            try:
                self.runners.stop()
            except Exception:  # the group may already be gone; the cache goes with it
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._inbox or self._cancels or self.scheduler.has_work or self._closing
                    ):
                        self._cond.wait()
                    if self._closing:
                        break
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                for live in inbox:
                    try:
                        self.scheduler.add(live.seq)
                    except ValueError as exc:  # this request alone is refused (a reused id, ...)
                        live.stream.put(Refusal(f"request {live.seq.id}: {exc}"))
                        continue
                    self._live[live.seq.id] = live
                    self.counters["requests"] += 1
                for request_id in cancels:
                    self._abort(request_id)
                if self.scheduler.has_work:
                    self._step()
        except BaseException as exc:  # a rank died or a step failed: every consumer hears it
            self._error = exc
            for live in list(self._live.values()) + self._inbox:
                live.stream.put(exc)
            self._live.clear()
            return
        for live in list(self._live.values()) + self._inbox:
            live.stream.put(Delta("", [], "abort"))
        self._live.clear()

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.scheduler.abort(request_id)
        if live.sent:
            self._removed.append(request_id)
        self.counters["aborted"] += 1
        live.stream.put(Delta(live.detok.flush(), [], "abort"))

    def _step(self) -> None:
        """Steps over the ranks. With one micro-batch (the default) one step, there and back. With
        more (one per pipeline stage), up to that many steps in flight on disjoint requests, each
        submitted as soon as one comes back, so every stage works on one while the next works on
        another (vLLM's virtual engines); new requests and cancellations wait until the steps in
        flight are back."""
        inflight: collections.deque = collections.deque()
        with self._group_lock:
            while True:
                while len(inflight) < self.config.micro_batches and not (
                    inflight and self._arrivals()
                ):
                    busy = frozenset(c.seq.id for plan, _, _ in inflight for c in plan.chunks)
                    plan = self.scheduler.schedule(busy, self.config.micro_batches)
                    self.counters["preemptions"] += len(plan.preempted)
                    if not plan.chunks:
                        break
                    work = self._work(plan)
                    # sent while another is in flight
                    self.counters["overlapped_steps"] += bool(inflight)
                    inflight.append((plan, work, self.runners.submit_step(work)))
                if not inflight:
                    # nothing fits until something finishes; cannot happen with work running
                    time.sleep(0.001)
                    return
                plan, work, handle = inflight.popleft()
                self._finish(plan, work, self.runners.collect_step(handle))
                if not inflight:
                    return

    def _arrivals(self) -> bool:
        """New requests or cancellations are waiting for the loop."""
        with self._cond:
            return bool(self._inbox or self._cancels or self._closing)

    def _work(self, plan) -> StepWork:
        """What the ranks need of a step: the packed new tokens, block tables, which rows to
        sample."""
        work = StepWork(ids=[], chunks=[], samples=[], removed=self._removed)
        self._removed = []
        bs = self.config.block_size
        for i, chunk in enumerate(plan.chunks):
            seq, live = chunk.seq, self._live[chunk.seq.id]
            end = chunk.start + chunk.length
            work.ids.extend(seq.tokens[chunk.start : end])
            prefix = seq.prompt_len if self.cfg.bidirectional_prompt and chunk.start == 0 else 0
            covered = end + chunk.drafts  # the table reaches the last draft the ranks may feed
            work.chunks.append(
                (
                    tuple(seq.blocks[: -(-covered // bs)]),
                    chunk.start,
                    chunk.length,
                    seq.state,
                    prefix,
                )
            )
            # the ranks keep MTP rows for drafting ones only
            work.seq_ids.append(seq.id if seq.drafts else None)
            if chunk.drafts:
                work.drafts.append((i, chunk.drafts))
            if chunk.samples:
                work.samples.append((i, seq.id))
            if not live.sent:
                work.added.append(NewSequence(seq.id, live.params, seq.tokens[: seq.prompt_len]))
                live.sent = True
                live.stream.cached_tokens = chunk.start
                self.counters["prompt_tokens"] += seq.prompt_len
            if live.steering is not None:
                work.steering.append((i, *live.steering))
            if live.adapter is not None:
                work.adapters.append((i, live.adapter))
        return work

    def _finish(self, plan, work: StepWork, result) -> None:
        """A step is back: its keys are in the cache, its sampled tokens go to their requests."""
        self.scheduler.after_step(plan)
        self.counters["steps"] += 1
        for n, ((i, seq_id), token, logprob) in enumerate(
            zip(work.samples, result.tokens, result.logprobs)
        ):
            live = self._live[seq_id]
            if n in result.drafted:
                kept = result.accepted[n]
                self.counters["drafted_tokens"] += result.drafted[n]
                self.counters["accepted_tokens"] += len(kept)
                self.counters["rejected_tokens"] += result.drafted[n] - len(kept)
                # verified, its k/v in the cache; a stop among them drops the rest
                for draft in kept:
                    self._take(live, draft, None, drafted=True)
                    if seq_id not in self._live:
                        break
                if seq_id not in self._live:
                    continue
            self._take(live, token, logprob, result.scores.get(n))

    def _take(
        self,
        live: _Live,
        token: int,
        logprob,
        scores: list[float] | None = None,
        drafted: bool = False,
    ) -> None:
        """One sampled (or verified draft) token for `live`: stream its text, retire the request
        when it is done."""
        seq, params = live.seq, live.params
        if drafted:
            self.scheduler.accept_draft(seq, token)
        else:
            self.scheduler.append(seq, token)
        self.counters["generated_tokens"] += 1
        reason = None
        text = ""
        if (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"  # the token ends the text; it is counted, not shown
        else:
            text = live.detok.add(token)
            if live.detok.stopped is not None:
                reason = "stop"
        if reason is None and len(seq.tokens) - seq.prompt_len >= params.max_tokens:
            reason = "length"
        if reason is not None:
            text += live.detok.flush()
            self.scheduler.finish(seq)
            self._live.pop(seq.id, None)
            self._removed.append(seq.id)
            self.counters["finished"] += 1
        live.stream.put(
            Delta(
                text,
                [token],
                reason,
                [logprob] if params.logprobs is not None else [],
                [scores] if params.logits_of else [],
            )
        )
