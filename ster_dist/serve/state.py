"""What one server holds: the job queue (Ster's endpoints run through it), the served model's
session pinned in its pool, that session's token engine, the adapters served as model names, and the
steering vectors requests name.

The model loads and the adapters register before the server says it is ready, so a bad --adapter
or --vectors is refused at start, in the CLI's words, not at the first request.
"""

from __future__ import annotations

import threading
import types
from pathlib import Path

from ster_dist.errors import Refusal
from ster_dist.jobqueue.client import LocalClient
from ster_dist.jobqueue.queue import JobQueue
from ster_dist.ops.generate import register_adapter, vector_key
from ster_dist.schema.serve import ServeRequest
from ster_dist.serve.metrics import Metrics


# steering vectors registered with the engine at most (it keeps each one for its life): clients send
# inline artifacts, and each new one would otherwise grow every rank's memory without bound
MAX_VECTORS = 64


class ServerState:
    def __init__(self, request: ServeRequest, state_dir: str | None = None):
        self.request = request
        self.name = request.name()
        self.max_queue = request.max_queue
        self.queue = JobQueue(state_dir)
        self.client = LocalClient(self.queue)
        self.session = None
        self.engine = None
        self.adapters: dict[str, str] = {}  # served name -> the engine's adapter key
        self._vectors: dict[tuple, str] = {}  # (path, mtime, size) -> the engine's vector key
        self._registered: set[str] = set()  # vector keys the engine holds
        self._vector_lock = threading.Lock()  # handlers register from worker threads
        self.in_flight = 0
        self.prompt_chars: int | None = None
        self.draining = False
        self.metrics = Metrics(self)

    def start(self) -> ServerState:
        """Check the settings' files, load the model, start the engine, register the adapters."""
        request = self.request
        if request.vectors is not None and not Path(request.vectors).is_dir():
            raise Refusal(
                f"{request.label('vectors')} {request.vectors} is not a directory; give the directory "
                "holding the steering artifacts (NAME.json) requests may name"
            )
        adapters = request.adapters()
        for name, directory in adapters.items():
            from ster_dist.adapters.format import open_adapter

            if name == self.name:
                raise Refusal(
                    f"{request.label('adapter')} {name}={directory} takes the model's own name; "
                    "give the adapter another"
                )
            open_adapter(directory)
        self.queue.pool.prepare(request.tp * request.ep)
        self.queue.start()
        self.session = self.queue.pool.pin(request)
        self.session.load()
        self.engine = self.session.engine(*request.engine_options())
        self.engine.warm_up()  # no request meets a compile mid-stream
        # Ster's /v1/generate jobs join this engine, never rebuild it
        self.session.fixed_engine = True
        self.prompt_chars = prompt_char_bound(self.session.tokenizer, self.session.cfg.max_position)
        for name, directory in adapters.items():
            self.adapters[name], _ = register_adapter(
                self.session,
                self.engine,
                types.SimpleNamespace(
                    adapter=directory, model=request.model, precision=request.precision
                ),
            )
        return self

    def models(self) -> list[str]:
        return [self.name, *self.adapters]

    def steering_key(self, artifact) -> str:
        """`artifact` (a SteeringArtifact) checked against the served model and registered once; a
        new one past MAX_VECTORS is refused."""
        from ster_dist.shard.fingerprint import weights_fingerprint
        from ster_dist.steer.artifact import check_for_run
        from ster_dist.steer.attach import payload

        cfg = self.session.cfg
        check_for_run(
            artifact,
            self.request.model,
            cfg.hidden_size,
            cfg.num_layers,
            fingerprint=weights_fingerprint(self.session.checkpoint),
        )
        vectors = payload(artifact)
        key = vector_key(vectors)
        with self._vector_lock:
            if key not in self._registered and len(self._registered) >= MAX_VECTORS:
                raise Refusal(
                    f"this server already holds {MAX_VECTORS} distinct steering vectors; name one of "
                    "--vectors DIR's or restart the server to register others"
                )
            self._registered.add(key)
        self.engine.add_vector(key, vectors)
        return key

    def named_vector(self, name: str) -> str:
        """The engine key of `--vectors DIR`'s NAME.json (read again when the file changes)."""
        from ster_dist.steer.artifact import load_artifact

        if self.request.vectors is None:
            raise LookupError("this server has no steering vectors; start it with --vectors DIR")
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise LookupError(
                f"steering vector {name!r} is not a plain name; give NAME of a NAME.json in the "
                "server's --vectors directory"
            )
        path = Path(self.request.vectors) / f"{name}.json"
        try:
            stat = path.stat()
        except OSError:
            raise LookupError(
                f"no steering vector named {name!r}: {path.name} is not in the server's --vectors "
                "directory"
            ) from None
        stamp = (str(path), stat.st_mtime_ns, stat.st_size)
        if stamp not in self._vectors:
            self._vectors[stamp] = self.steering_key(load_artifact(str(path)))
        return self._vectors[stamp]

    def close(self) -> None:
        self.queue.close(timeout=30)


# pre-tokenizers and normalizers that may drop characters (whitespace, accents), for which the
# number
# of characters says nothing of the number of tokens
_DROPPING = ("Whitespace", "Bert", "Strip", "CharDelimiterSplit")


def prompt_char_bound(tokenizer, max_position: int) -> int | None:
    """The most characters `max_position` tokens can cover: no token covers more characters than its
    vocabulary string has (a byte-level token has one character per byte, a SentencePiece one its
    own text, a byte-fallback token more than its one byte), doubled for normalizers that compose
    characters. None when the tokenizer may drop characters."""
    backend = tokenizer.backend
    if any(
        word in repr(part)
        for part in (backend.normalizer, backend.pre_tokenizer)
        for word in _DROPPING
    ):
        return None
    longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1)
    return 2 * max(longest, 1) * max_position
