"""The server's Prometheus metrics (prometheus-client, a registry per server so tests can run
several).

Counted as requests go: requests by endpoint and status, prompt and generated tokens, time to first
token, inter-token latency and whole-request latency. Read from the engine at each scrape: requests
running and waiting, KV blocks in use and in all, the prefix cache's hit rate, and speculative
decoding's draft and accepted tokens. Names follow vLLM's with the prefix `ster_` (a colon is for
Prometheus' recording rules, never an exporter's names), so its dashboards need only the prefix
changed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Metrics:
    def __init__(self, state):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ster_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "ster_prompt_tokens", "prompt tokens of served requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "ster_generation_tokens", "tokens generated for served requests", registry=self.registry
        )
        self.ttft = Histogram(
            "ster_time_to_first_token_seconds",
            "from a request's arrival to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "ster_inter_token_latency_seconds",
            "between consecutive streamed tokens",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "ster_e2e_request_latency_seconds",
            "from a request's arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(state))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from the engine when Prometheus scrapes, so they are never stale."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        engine = self.state.engine
        stats = engine.stats() if engine is not None else None
        blocks = stats["kv_blocks"] if stats else {}
        gauges = (
            (
                "ster_num_requests_running",
                "requests the engine is generating for",
                stats and stats["running"],
            ),
            (
                "ster_num_requests_waiting",
                "requests queued for the engine",
                stats and stats["waiting"],
            ),
            ("ster_http_requests_in_flight", "HTTP requests being answered", self.state.in_flight),
            (
                "ster_kv_cache_blocks_in_use",
                "KV cache blocks holding tokens of running requests",
                blocks.get("used"),
            ),
            (
                "ster_kv_cache_blocks_total",
                "KV cache blocks in all (per rank)",
                blocks.get("total"),
            ),
            (
                "ster_prefix_cache_hit_rate",
                "prompt blocks served from the prefix cache / blocks asked",
                blocks.get("hit_rate"),
            ),
        )
        for name, help_text, value in gauges:
            family = GaugeMetricFamily(name, help_text)
            family.add_metric([], float(value or 0))
            yield family
        preempted = CounterMetricFamily(
            "ster_num_preemptions", "requests preempted (recomputed) for KV blocks"
        )
        preempted.add_metric([], float(stats["preemptions"]) if stats else 0.0)
        yield preempted
        # speculative decoding (--speculative mtp): vLLM's spec_decode counters; zero without drafts
        for key, name, help_text in (
            ("drafted_tokens", "ster_spec_decode_num_draft_tokens", "draft tokens proposed"),
            (
                "accepted_tokens",
                "ster_spec_decode_num_accepted_tokens",
                "draft tokens the model verified",
            ),
        ):
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], float(stats[key]) if stats else 0.0)
            yield family
