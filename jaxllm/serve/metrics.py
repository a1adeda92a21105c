"""Prometheus metrics of one server, in a registry of its own (several apps in one process
do not clash). Engine state and totals are read from `engine.stats()` at scrape time;
latencies are observed once per finished request from its RequestOutput times, with
TPOT = (E2E - TTFT) / (output tokens - 1) as vLLM defines it."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# stats() key -> (gauge name, help)
GAUGES = {
    "running": ("jaxllm_requests_running", "Requests in the engine's running batch."),
    "waiting": ("jaxllm_requests_waiting", "Requests queued for the running batch."),
    "pages_used": ("jaxllm_kv_pages_used", "KV cache pages holding a sequence's tokens."),
    "pages_total": ("jaxllm_kv_pages_total", "KV cache pages in the pool."),
}
# stats() key -> (counter name without _total, help)
COUNTERS = {
    "preemptions": ("jaxllm_preemptions", "Sequences preempted for want of KV pages."),
    "prefix_queries": ("jaxllm_prefix_cache_queries",
                       "Prompt tokens looked up in the prefix cache."),
    "prefix_hits": ("jaxllm_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "prompt_tokens": ("jaxllm_prompt_tokens", "Prompt tokens processed."),
    "generation_tokens": ("jaxllm_generation_tokens", "Tokens generated."),
    "requests_finished": ("jaxllm_requests_finished", "Requests finished."),
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for key, (name, doc) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=stats[key])
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats[key])
        queries = stats["prefix_queries"]
        yield GaugeMetricFamily("jaxllm_prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / looked up (all time).",
                                value=stats["prefix_hits"] / queries if queries else 0.0)


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("jaxllm_time_to_first_token_seconds",
                              "From arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("jaxllm_time_per_output_token_seconds",
                              "(E2E - TTFT) / (output tokens - 1), per request.",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("jaxllm_e2e_request_latency_seconds",
                             "From arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe(self, out) -> None:
        """A finished RequestOutput's latencies."""
        if out.first_token_time is None or out.finish_time is None:
            return  # ended before its first token (aborted)
        ttft = out.first_token_time - out.arrival_time
        e2e = out.finish_time - out.arrival_time
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if out.completion_tokens > 1:
            self.tpot.observe((e2e - ttft) / (out.completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
