"""Batch inference over Ray Data: `ster batch` (run.py) and `processor(...)` for `map_batches`
(processor.py), N replicas of a model as an actor pool (replica.py), rows read and keyed as
rows.py says."""

from ster_dist.batch.processor import processor

__all__ = ["processor"]
