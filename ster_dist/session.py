"""The driver's view of one model run: the checkpoint resolved once, its config and tokenizer, and
the worker group that holds the weights.

Everything is resolved on first use, so an operation checks its own inputs (files, flags) before
it touches the session, and a refused input never costs a download or a model load. The job queue
keeps sessions in its pool (jobqueue/pool.py) and hands the same one to every job on that model.
"""

from __future__ import annotations

import contextlib
import functools
import threading

from ster_dist.events import progress
from ster_dist.schema.common import Runtime


class Session:
    def __init__(self, runtime: Runtime, address: str | None = None, on_load=None):
        from ster_dist.load import check_device, compute_dtype

        self.runtime = runtime
        self.address = address if address is not None else runtime.address
        check_device(runtime.device)
        compute_dtype(runtime.precision, runtime.device)
        # what modifiers (vectors, adapters) attached, for output records
        self.provenance: dict = {}
        self._group = None
        self._engine = None
        # two job-queue lanes asking at once get one engine: two over the same ranks would each
        # number
        # their requests from r0 and collide in the ranks' sampler
        self._engine_lock = threading.Lock()
        # a lane's job and the queue's warm-up may ask at once: one load
        self._load_lock = threading.Lock()
        # set by `ster serve`: jobs' engine options never rebuild its engine
        self.fixed_engine = False
        # called with the session once its ranks hold the model (the pool counts it)
        self._on_load = on_load

    @functools.cached_property
    def checkpoint(self):
        from ster_dist.resolve import resolve

        progress(f"resolving {self.runtime.model}")
        return resolve(self.runtime.model, self.runtime.revision)

    @functools.cached_property
    def cfg(self):
        from ster_dist.config.load import model_config

        return model_config(self.checkpoint)

    @functools.cached_property
    def tokenizer(self):
        from ster_dist.tokenizer import Tokenizer

        return Tokenizer.from_directory(self.checkpoint.directory)

    @property
    def eos(self) -> tuple[int, ...]:
        eos_id = self.tokenizer.eos_token_id
        return self.cfg.eos_token_ids or ((eos_id,) if eos_id is not None else ())

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    @property
    def loaded(self) -> bool:
        return self._group is not None

    @property
    def group(self):
        """The ranks holding this model, loaded on first use."""
        if self._group is None:
            self.load()
        return self._group

    def load(self) -> list[dict]:
        """Open the worker group and load the model on every rank (once: a loaded session returns
        what its load reported)."""
        with self._load_lock:
            return self._load()

    def _load(self) -> list[dict]:
        from ster_dist.load import check_weights
        from ster_dist.parallel.pipeline import check_pipeline
        from ster_dist.workers.group import load_on, open_group

        if self._group is not None:
            return self.loads
        rt = self.runtime
        checkpoint, cfg = self.checkpoint, self.cfg  # resolved and gated before any rank starts
        check_weights(cfg, rt.weights, rt.model, checkpoint.weight_format, rt.device)
        check_pipeline(cfg, rt.pp)
        world = rt.tp * rt.ep * rt.pp
        where = f"{world} ranks" if world > 1 else "1 Ray actor" if self.address else "this process"
        progress(
            f"loading {checkpoint.weight_format} weights ({len(checkpoint.weight_files)} files) in {where}"
        )
        group = open_group(rt.tp, rt.device, self.address, ep=rt.ep, pp=rt.pp)
        try:
            self.loads = load_on(group, checkpoint, rt.precision, rt.device, rt.weights)
        except BaseException:
            group.close()
            raise
        self._group = group
        if self._on_load is not None:
            self._on_load(self)
        return self.loads

    def engine(
        self,
        kv_cache_memory: int | None = None,
        max_step_tokens: int = 512,
        speculative_tokens: int = 0,
        enforce_eager: bool = False,
        pack_weights: str = "auto",
        kernels: str | None = None,
    ):
        """The token engine over this session's ranks (engine/loop.py), made on first use; other
        options rebuild it once the running one has nothing in flight, and one a failed step stopped
        is replaced. speculative_tokens: MTP drafts per decode (engine/drafter.py), 0 for none;
        enforce_eager: never compile the layers (model/compiled.py); pack_weights: "auto", "on" or
        "off" (parallel/packed.py);
        kernels:
        "triton", "native", "torch" or None for the device's default (kernels/select.py)."""
        from ster_dist.engine.loop import COMPILE_AFTER, EngineConfig

        # one step in flight per pipeline stage, so the stages work at once on different requests
        config = EngineConfig(
            kv_cache_memory=kv_cache_memory,
            max_step_tokens=max_step_tokens,
            micro_batches=self.runtime.pp,
            speculative_tokens=speculative_tokens,
            compile_after=None if enforce_eager else COMPILE_AFTER,
            pack_weights=pack_weights,
            kernels=kernels,
        )
        with self._engine_lock:
            return self._engine_for(config)

    def _engine_for(self, config):
        from ster_dist.engine.loop import TokenEngine

        if self.fixed_engine and self._engine is not None and not self._engine.stopped:
            return self._engine  # a server's: its clients hold streams of it, whatever a job asks
        if self._engine is not None and (
            self._engine.stopped or self._engine.config != config and self._engine.idle
        ):
            self._engine.close()
            self._engine = None
        if self._engine is None:
            self._engine = TokenEngine(self.group, self.cfg, self.tokenizer, self.eos, config)
            blocks, slots = self._engine.pool.stats()["total"], self._engine.stats()["state_slots"]
            # a model with recurrent layers: a state per running request, and no prefix sharing
            # (engine/scheduler.py)
            states = (
                f"; {slots} recurrent-state slots ({slots * self._engine.state_bytes / 2**20:.0f} MiB per rank), "
                "prefix caching off"
                if slots
                else ""
            )
            progress(
                f"KV cache: {blocks} blocks of {config.block_size} tokens "
                f"({blocks * self._engine.block_bytes / 2**20:.0f} MiB per rank){states}"
            )
        return self._engine

    @contextlib.contextmanager
    def exclusive(self):
        """The ranks to the caller alone for the block: a running token engine finishes its step,
        then waits (its requests stay in flight) until the block ends."""
        engine = self._engine
        if engine is None:
            yield
            return
        with engine.paused():
            yield

    def close(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.close()
        if self._group is not None:
            group, self._group = self._group, None
            group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def modifiers(session: Session, request, steering: bool = True):
    """Attach the request's adapter (and, for generation, its steering vector) to every rank for the
    block, and detach them after, so a pooled group is clean for the next job."""
    from ster_dist.adapters.attach import attach_for_cli as attach_adapter
    from ster_dist.steer.attach import attach_for_cli as attach_vector

    detach = []
    try:
        if steering and getattr(request, "vector", None) is not None:
            detach.append(attach_vector(session, request))
        if getattr(request, "adapter", None) is not None:
            detach.append(attach_adapter(session, request))
        yield
    finally:
        for undo in reversed(detach):
            undo()
