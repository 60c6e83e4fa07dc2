"""The token-level engine: continuous batching over a paged KV cache, prefix caching, per-request
sampling, steering and adapters, and streaming (driver-side scheduling, rank-side running)."""
