"""Prometheus metrics for `GET /metrics`, with vLLM's metric names under the `armserve:` prefix,
and the engine's series also under vLLM's own `vllm:` prefix (same values), so dashboards and
autoscalers built for vLLM (KServe, llm-d) read armserve unchanged.

Engine metrics are recorded from the engine thread (a `StatLogger`); HTTP metrics from the
access-log middleware. Each server owns its own registry, so several servers in one process
(tests) never collide.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)

from armserve.engine.async_llm import IterationStats, SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _Twin:
    """An armserve series and its `vllm:` twin, updated together."""

    def __init__(self, *children) -> None:
        self.children = children

    def set(self, v: float) -> None:
        for c in self.children:
            c.set(v)

    def inc(self, v: float = 1.0) -> None:
        for c in self.children:
            c.inc(v)

    def observe(self, v: float) -> None:
        for c in self.children:
            c.observe(v)

    def labels(self, **kw) -> "_Twin":
        return _Twin(*(c.labels(**kw) for c in self.children))


class PrometheusMetrics:
    """All of one server's metrics; also a `StatLogger` for `AsyncLLM`."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # the *_created series only double the size of a scrape
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        # armserve:<name>, and with `twin` also vllm:<name> (a series vLLM exports under that name
        # and meaning), updated together
        def series(kind, name: str, doc: str, twin: bool, **kw):
            made = [kind(f"{p}:{name}", doc, labels, registry=r, **kw).labels(**self._labels)
                    for p in (("armserve", "vllm") if twin else ("armserve",))]
            return _Twin(*made) if twin else made[0]

        def gauge(name: str, doc: str, twin: bool = False):
            return series(Gauge, name, doc, twin)

        def counter(name: str, doc: str, twin: bool = False):
            return series(Counter, name, doc, twin)

        def histogram(name: str, doc: str, buckets) -> _Twin:  # every histogram has its vLLM twin
            return series(Histogram, name, doc, True, buckets=buckets)

        self.num_running = gauge("num_requests_running", "Requests in the running batch.", twin=True)
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.", twin=True)
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", twin=True)
        self.kv_used = gauge("kv_cache_used_blocks", "KV cache blocks held by requests.")
        self.kv_total = gauge("kv_cache_total_blocks", "KV cache blocks in the pool.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hit rate over all queried prompt tokens (0-1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", twin=True)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", twin=True)
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.", twin=True)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.", twin=True)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.", twin=True)
        self.request_success = _Twin(*(Counter(
            f"{p}:request_success", "Requests finished, by finish reason (stop, length, abort).",
            labels + ["finished_reason"], registry=r,
        ) for p in ("armserve", "vllm")))
        for reason in ("stop", "length", "abort"):  # export zeros, so a scrape sees every series
            self.request_success.labels(finished_reason=reason, **self._labels)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token of each request (after the first).", _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.",
                                    _LATENCY_BUCKETS)
        self.req_prompt_tokens = histogram("request_prompt_tokens", "Prompt length per request.",
                                           _TOKEN_BUCKETS)
        self.req_gen_tokens = histogram("request_generation_tokens", "Generated tokens per request.",
                                        _TOKEN_BUCKETS)
        self.http_requests = Counter("armserve:http_requests", "HTTP requests by method, path and status.",
                                     ["method", "handler", "status"], registry=r)
        self.http_latency = Histogram("armserve:http_request_duration_seconds",
                                      "HTTP request duration (whole stream for SSE).", ["method", "handler"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self._last_queries = self._last_hits = self._last_preemptions = 0

    # StatLogger protocol: called from the engine thread.
    def record(self, s: SchedulerStats, it: IterationStats) -> None:
        self.num_running.set(s.num_running)
        self.num_waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.kv_used.set(s.kv_blocks_used)
        self.kv_total.set(s.kv_blocks_total)
        self.prefix_hit_rate.set(s.prefix_cache_hit_rate)
        # The engine keeps cumulative totals; counters only take increments.
        self.prefix_queries.inc(s.prefix_cache_queries - self._last_queries)
        self.prefix_hits.inc(s.prefix_cache_hits - self._last_hits)
        self.preemptions.inc(s.num_preemptions - self._last_preemptions)
        self._last_queries, self._last_hits = s.prefix_cache_queries, s.prefix_cache_hits
        self._last_preemptions = s.num_preemptions
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for f in it.finished:
            self.request_success.labels(finished_reason=f.finish_reason, **self._labels).inc()
            self.e2e.observe(f.e2e_latency)
            self.req_prompt_tokens.observe(f.num_prompt_tokens)
            self.req_gen_tokens.observe(f.num_generation_tokens)
            if f.queue_time is not None:
                self.queue_time.observe(f.queue_time)
            if f.time_per_output_token is not None:
                self.tpot.observe(f.time_per_output_token)

    def record_http(self, method: str, handler: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method=method, handler=handler, status=str(status)).inc()
        self.http_latency.labels(method=method, handler=handler).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
