"""The scheduler's parts: journal, worker-group pool, generate batching, progress events, the Ray actor."""
