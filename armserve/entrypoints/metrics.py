"""Prometheus metrics for `GET /metrics`, with vLLM's metric names under the `armserve:` prefix,
and the engine's series also under vLLM's own `vllm:` prefix (same values), so dashboards and
autoscalers built for vLLM (KServe, llm-d) read armserve unchanged.

Engine metrics are recorded after every engine step (a `StatLogger`), labelled with the engine's
index as vLLM does (`engine="0"`; with `--data-parallel-size N`, one series per engine: a sum over
`engine` gives the server's totals); HTTP metrics come from the access-log middleware. Each server
owns its own registry, so several servers in one process (tests) never collide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partialmethod
from typing import Any

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

from armserve.engine.stats import IterationStats, SchedulerStats, SpecDecodingStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# vLLM's buckets for the series below (same bounds, so its dashboards' quantiles read the same)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_REQUEST_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                          240.0, 480.0, 960.0, 1920.0, 7680.0)


class _Twin:
    """An armserve series and its `vllm:` twin, updated together."""

    def __init__(self, *children) -> None:
        self.children = children

    def _each(self, method: str, *args: Any) -> None:
        for c in self.children:
            getattr(c, method)(*args)

    set = partialmethod(_each, "set")
    inc = partialmethod(_each, "inc")
    observe = partialmethod(_each, "observe")

    def labels(self, **kw) -> "_Twin":
        return _Twin(*(c.labels(**kw) for c in self.children))


@dataclass
class _EngineSeries:
    """One engine's children of every engine metric, and the cumulative totals last seen."""

    gauges: dict[str, Any]
    counters: dict[str, Any]
    histograms: dict[str, Any]
    request_success: Any
    last: dict[str, int] = field(default_factory=dict)  # CUMULATIVE name -> total
    last_spec: SpecDecodingStats | None = None


class PrometheusMetrics:
    """All of one server's metrics; also a `StatLogger` for `AsyncLLM`."""

    # name -> (help, vLLM twin, the SchedulerStats attribute shown)
    GAUGES = {
        "num_requests_running": ("Requests in the running batch.", True, "num_running"),
        "num_requests_waiting": ("Requests waiting to be scheduled.", True, "num_waiting"),
        "kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0-1).", True, "kv_cache_usage"),
        "kv_cache_used_blocks": ("KV cache blocks held by requests.", False, "kv_blocks_used"),
        "kv_cache_total_blocks": ("KV cache blocks in the pool.", False, "kv_blocks_total"),
        "prefix_cache_hit_rate": ("Prefix-cache hit rate over all queried prompt tokens (0-1).", False,
                                  "prefix_cache_hit_rate"),
    }
    # name -> (help, vLLM twin)
    COUNTERS = {
        "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", True),
        "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", True),
        "num_preemptions": ("Requests preempted for lack of KV blocks.", True),
        "prompt_tokens": ("Prompt tokens prefilled.", True),
        "generation_tokens": ("Tokens generated.", True),
        # speculative decoding (0 without it)
        "spec_decode_num_drafts": ("Speculative decoding: draft runs verified.", True),
        "spec_decode_num_draft_tokens": ("Speculative decoding: draft tokens verified.", True),
        "spec_decode_num_accepted_tokens": ("Speculative decoding: draft tokens accepted.", True),
    }
    CUMULATIVE = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")  # SchedulerStats' totals
    HISTOGRAMS = {  # every histogram has its vLLM twin
        "time_to_first_token_seconds": ("Time to first token.", _LATENCY_BUCKETS),
        "time_per_output_token_seconds": ("Mean time per output token of each request (after the first).",
                                          _TPOT_BUCKETS),
        "e2e_request_latency_seconds": ("End-to-end request latency.", _LATENCY_BUCKETS),
        "request_queue_time_seconds": ("Time waiting before first scheduled.", _LATENCY_BUCKETS),
        "request_prompt_tokens": ("Prompt length per request.", _TOKEN_BUCKETS),
        "request_generation_tokens": ("Generated tokens per request.", _TOKEN_BUCKETS),
        "iteration_tokens_total": ("Tokens per engine step (prompt tokens computed plus tokens generated).",
                                   _ITERATION_TOKEN_BUCKETS),
        "inter_token_latency_seconds": ("Time between a request's consecutive tokens.", _ITL_BUCKETS),
        "request_prefill_time_seconds": ("Time from a request's first scheduling to its first token (PREFILL phase).",
                                         _REQUEST_PHASE_BUCKETS),
        "request_decode_time_seconds": ("Time from a request's first token to its last (DECODE phase).",
                                        _REQUEST_PHASE_BUCKETS),
    }

    REJECTION_REASONS = ("overloaded", "body_too_large", "body_timeout", "draining")

    def set_kernels(self, status: dict[str, str]) -> None:
        """`armserve:kernels_info` from the engine's kernels.status()."""
        self._kernels.clear()
        self._kernels.labels(**status).set(1)

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        disable_created_metrics()  # the *_created series only double the size of a scrape
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.model_name = model_name
        labels = ["model_name", "engine"]
        # armserve's own (no vLLM twin): 1, with the kernel variant in use (`torch` on the PyTorch
        # path, then available="false" and the reason), so a dashboard sees a server running slow.
        # Set from the engine's report (`set_kernels`): this process (a server's front end) never
        # loads the kernels or torch.
        self._kernels = Gauge("armserve:kernels_info", "The C++ kernel library: the variant in use, the variants "
                              "built in, and why it is unavailable.", ["isa", "available", "variants", "reason"],
                              registry=r)

        # armserve:<name>, and with `twin` also vllm:<name> (a series vLLM exports under that name
        # and meaning), updated together
        def family(kind, name: str, doc: str, twin: bool, extra: tuple[str, ...] = (), **kw) -> _Twin:
            return _Twin(*(kind(f"{p}:{name}", doc, labels + list(extra), registry=r, **kw)
                           for p in (("armserve", "vllm") if twin else ("armserve",))))

        self._gauges = {n: family(Gauge, n, doc, twin) for n, (doc, twin, _) in self.GAUGES.items()}
        self._counters = {n: family(Counter, n, doc, twin) for n, (doc, twin) in self.COUNTERS.items()}
        self._histograms = {n: family(Histogram, n, doc, True, buckets=b) for n, (doc, b) in self.HISTOGRAMS.items()}
        self._request_success = family(Counter, "request_success",
                                       "Requests finished, by finish reason (stop, length, abort).", True,
                                       ("finished_reason",))
        self._accepted_per_pos = family(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                        "Speculative decoding: draft tokens accepted, by draft position (0-based).",
                                        True, ("position",))
        self._engines: dict[int, _EngineSeries] = {}
        for i in range(num_engines):  # export zeros, so a scrape sees every series from the start
            self._engine(i)
        self.http_requests = Counter("armserve:http_requests", "HTTP requests by method, path and status.",
                                     ["method", "handler", "status"], registry=r)
        self.http_latency = Histogram("armserve:http_request_duration_seconds",
                                      "HTTP request duration (whole stream for SSE).", ["method", "handler"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("armserve:requests_rejected",
                                "Requests refused before reaching the engine, by reason: overloaded (429), "
                                "body_too_large (413), body_timeout (408), draining (503 while shutting down).",
                                ["reason"], registry=r)
        for reason in self.REJECTION_REASONS:  # zeros from the start
            self.rejected.labels(reason=reason)

    def _engine(self, engine: int) -> _EngineSeries:
        e = self._engines.get(engine)
        if e is None:
            lab = {"model_name": self.model_name, "engine": str(engine)}
            e = _EngineSeries({n: f.labels(**lab) for n, f in self._gauges.items()},
                              {n: f.labels(**lab) for n, f in self._counters.items()},
                              {n: f.labels(**lab) for n, f in self._histograms.items()},
                              {reason: self._request_success.labels(finished_reason=reason, **lab)
                               for reason in ("stop", "length", "abort")})
            self._engines[engine] = e
        return e

    # StatLogger protocol: called after every step, from the thread that receives the engine's outputs.
    def record(self, s: SchedulerStats, it: IterationStats, engine: int = 0) -> None:
        e = self._engine(engine)
        g, c, h = e.gauges, e.counters, e.histograms
        for name, (_, _, attr) in self.GAUGES.items():
            g[name].set(getattr(s, attr))
        for name in self.CUMULATIVE:  # the engine keeps totals; counters only take increments
            c[name].inc(getattr(s, name) - e.last.get(name, 0))
            e.last[name] = getattr(s, name)
        if s.spec_decoding is not None:
            self._record_spec(e, s.spec_decoding, engine)
        c["prompt_tokens"].inc(it.num_prompt_tokens)
        c["generation_tokens"].inc(it.num_generation_tokens)
        if it.step:
            h["iteration_tokens_total"].observe(it.num_prompt_tokens + it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            h["time_to_first_token_seconds"].observe(t)
        for t in it.inter_token_latencies:
            h["inter_token_latency_seconds"].observe(t)
        for f in it.finished:
            e.request_success[f.finish_reason].inc()
            h["e2e_request_latency_seconds"].observe(f.e2e_latency)
            h["request_prompt_tokens"].observe(f.num_prompt_tokens)
            h["request_generation_tokens"].observe(f.num_generation_tokens)
            if f.queue_time is not None:
                h["request_queue_time_seconds"].observe(f.queue_time)
            if f.time_per_output_token is not None:
                h["time_per_output_token_seconds"].observe(f.time_per_output_token)
            if f.prefill_time is not None:
                h["request_prefill_time_seconds"].observe(f.prefill_time)
            if f.decode_time is not None:
                h["request_decode_time_seconds"].observe(f.decode_time)

    def set_cache_config(self, engine: Any) -> None:
        """vLLM's `cache_config_info` of a started `AsyncLLM`: a gauge at 1 whose labels are its KV
        cache's configuration, with vLLM's CacheConfig names (the CPU KV cache is what vLLM's CPU
        backend counts in num_gpu_blocks), one series per engine; and its kernels (`set_kernels`)."""
        if engine.kernels_status is not None:
            self.set_kernels(engine.kernels_status)
        cfg, ip = engine.config, engine.input_processor
        info = {"block_size": ip.block_size, "cache_dtype": cfg.kv_cache_dtype,
                "enable_prefix_caching": cfg.enable_prefix_caching, "num_gpu_blocks": ip.num_kv_blocks,
                "num_cpu_blocks": None, "cpu_kvcache_space_bytes": int((cfg.kv_cache_space or 0) * 2**30)}
        names = sorted(info) + ["engine"]
        for prefix in ("armserve", "vllm"):
            g = Gauge(f"{prefix}:cache_config_info", "Information of the engine's KV cache configuration.", names,
                      registry=self.registry)
            for engine in self._engines:
                g.labels(**{k: str(v) for k, v in info.items()}, engine=str(engine)).set(1)

    def _record_spec(self, e: _EngineSeries, sd: SpecDecodingStats, engine: int) -> None:
        last = e.last_spec or SpecDecodingStats.empty(len(sd.num_accepted_tokens_per_pos))
        c = e.counters
        c["spec_decode_num_drafts"].inc(sd.num_drafts - last.num_drafts)
        c["spec_decode_num_draft_tokens"].inc(sd.num_draft_tokens - last.num_draft_tokens)
        c["spec_decode_num_accepted_tokens"].inc(sd.num_accepted_tokens - last.num_accepted_tokens)
        lab = {"model_name": self.model_name, "engine": str(engine)}
        for j, v in enumerate(sd.num_accepted_tokens_per_pos):
            before = last.num_accepted_tokens_per_pos[j] if j < len(last.num_accepted_tokens_per_pos) else 0
            self._accepted_per_pos.labels(position=str(j), **lab).inc(v - before)
        e.last_spec = sd.copy()

    def record_rejection(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def record_http(self, method: str, handler: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method=method, handler=handler, status=str(status)).inc()
        self.http_latency.labels(method=method, handler=handler).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
