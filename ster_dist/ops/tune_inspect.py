"""tune inspect: an adapter read and checked as every reader reads it (adapters/format.py), and
summarised without its numbers, as `vector inspect` summarises a steering artifact."""

from __future__ import annotations

from ster_dist.schema.tune import TuneInspectRequest


def inspect(request: TuneInspectRequest) -> dict:
    from ster_dist.adapters.format import open_adapter

    adapter = open_adapter(request.adapter)
    return {
        "adapter": str(adapter.path),
        "format": adapter.format,
        "kind": adapter.kind,
        "model": adapter.model,
        "model_revision": adapter.model_revision,
        "hidden_size": adapter.hidden_size,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "use_rslora": adapter.use_rslora,
        "weights": str(adapter.weights),
        "factors": [
            {
                "key": f.key,
                "a": f.a,
                "a_shape": list(f.a_shape),
                "b": f.b,
                "b_shape": list(f.b_shape),
                "rank": f.rank,
                "alpha": f.alpha,
                "scale": f.scale,
            }
            for f in adapter.factors
        ],
    }
