"""`ster_dist.batch.processor(...)`: what `Dataset.map_batches` takes to answer a dataset's rows
with a model, the Python form of `ster batch` (as `ray.data.llm.build_processor` is vLLM's):

    import ray.data from ster_dist.batch import processor

    ds = ray.data.read_json("prompts.jsonl", lines=True)
    ds.map_batches(processor(model="models/smollm2", max_new_tokens=32), concurrency=2,
    batch_size=64,
                   batch_format="pandas").write_parquet("answers/")

Each row carries `prompt` (text) or `messages` (a chat) and, optionally, the sampling fields
`ster generate` takes (rows.py ROW_FIELDS); the keyword arguments here are every row's defaults.
"""

from __future__ import annotations

import functools

from ster_dist.batch.replica import Replica
from ster_dist.batch.rows import ROW_FIELDS
from ster_dist.errors import Refusal

RUNTIME_FIELDS = (
    "revision",
    "precision",
    "device",
    "tp",
    "ep",
    "pp",
    "weights",
    "kv_cache_memory",
    "max_step_tokens",
    "enforce_eager",
    "pack_weights",
)


def processor(request=None, *, model: str | None = None, chat_template: str = "auto", **fields):
    """A Replica class bound to its model and defaults, for `map_batches(..., concurrency=N)`. Takes
    a BatchRequest (`ster batch`'s) or keyword arguments: model, runtime fields (tp, precision, ...)
    and row defaults (max_new_tokens, temperature, seed, ...)."""
    if request is not None:
        model, chat_template = request.model, request.chat_template
        fields = {
            name: getattr(request, name)
            for name in (*RUNTIME_FIELDS, "max_new_tokens")
            if name in request.model_fields_set or name == "max_new_tokens"
        }
    if not model:
        raise Refusal("processor() needs a model (a local directory or a Hub id)")
    unknown = set(fields) - set(RUNTIME_FIELDS) - set(ROW_FIELDS)
    if unknown:
        raise Refusal(
            f"processor() takes no {', '.join(sorted(unknown))}; runtime fields are "
            f"{', '.join(RUNTIME_FIELDS)} and row defaults {', '.join(ROW_FIELDS)}"
        )
    runtime = {k: v for k, v in fields.items() if k in RUNTIME_FIELDS}
    defaults = {k: v for k, v in fields.items() if k in ROW_FIELDS}

    class BoundReplica(Replica):
        __init__ = functools.partialmethod(
            Replica.__init__, model, runtime, defaults, chat_template
        )

    BoundReplica.__name__ = BoundReplica.__qualname__ = "SterReplica"
    return BoundReplica
