"""Prometheus metrics, named like vLLM's (`vllm:...`) so existing vLLM dashboards fit.

Each PieServer owns one `ServiceMetrics` with its own CollectorRegistry (never the process-global
one), so several servers in one process do not clash. Two kinds of series:

- observed by the servicer as requests finish: token counters, request_success, the latency
  histograms, and `pie_requests_finished_total{rpc, code}` (every RPC outcome by gRPC status code);
- read from `engine.stats()` at scrape time by `_EngineCollector`: running/waiting requests, KV
  usage, and the engine's cumulative prefix-cache, preemption and (with `--speculative`)
  speculative-decoding counters (vLLM v1's `spec_decode_*`, their per-position counter labelled
  `position` 0..K-1, every position from the first scrape).

Inter-token latency with coalesced stream messages: one message may carry k tokens made since the
previous one; the gap since the previous message is divided by k and observed k times, so the
histogram holds one sample per generated token after the first (as vLLM's does) and its sum is the
decode time.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from pie.engine.messages import STEP_BUCKETS, STEP_KINDS, EngineStats

# Bucket edges follow vLLM's (seconds); requests on the CPU are slower, hence the long tails.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

FINISHED_REASONS = ("stop", "length", "abort")  # request_success label values, as in vLLM
METRICS_PATH = "/metrics"  # the one path the HTTP endpoint answers; any other is 404


def _bound(seconds: float) -> str:
    """A histogram bucket's `le` label."""
    return "+Inf" if seconds == float("inf") else repr(seconds)


class _EngineCollector(Collector):
    """Scheduler and cache state, read from the engine when Prometheus scrapes (never cached)."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None],
                 num_speculative_tokens: int | None = None, max_loras: int = 0,
                 cache_config: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.cache_config = cache_config or {}  # vllm:cache_config_info's fixed labels (block_size, cache_dtype)
        self.max_loras = max_loras  # LoRA slots (--max-loras); 0: no adapters (no lora series)
        self.stats = stats  # None while the model is still loading
        self.num_speculative_tokens = num_speculative_tokens  # K; None: speculative decoding off (no series)

    def describe(self):
        return []  # the series appear only once the engine exists; skip the registry's dry run

    def collect(self):
        stats = self.stats()
        if stats is None:
            return
        labels, value = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    stats.requests_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    stats.requests_waiting)
        used = stats.kv_blocks_total - stats.kv_blocks_free
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        # vLLM's cache_config_info, which the Gateway API Inference Extension's prefix-cache scorer
        # reads its block_size and num_gpu_blocks labels off (value 1, as an info metric)
        # (num_cpu_blocks as vLLM's: the host tier's blocks, 0 without one)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config.",
                                 labels=[*self.cache_config, "num_gpu_blocks", "num_cpu_blocks"])
        info.add_metric([*self.cache_config.values(), str(stats.kv_blocks_total), str(stats.kv_host_blocks_total)], 1.0)
        yield info
        yield gauge("pie_kv_blocks_cached", "Free KV blocks that still hold a cached prompt prefix (reusable).",
                    stats.kv_blocks_cached)
        by_priority = GaugeMetricFamily("pie_requests_waiting_by_priority",
                                        "Requests waiting to be processed, by their priority (lower runs first).",
                                        labels=["model_name", "priority"])
        for priority, n in sorted(stats.requests_waiting_by_priority.items()):
            by_priority.add_metric([self.model_name, str(priority)], n)
        yield by_priority
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                      stats.num_preemptions)
        steps = HistogramMetricFamily("pie_step_duration_seconds",
                                      "Engine steps by duration (time between two steps' tokens while busy), by "
                                      "kind: decode-only steps, steps that carry prompt tokens.",
                                      labels=["model_name", "kind"])
        for kind in STEP_KINDS:
            counts = stats.step_buckets.get(kind, [0] * len(STEP_BUCKETS))
            cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]
            steps.add_metric([self.model_name, kind], [(_bound(b), c) for b, c in zip(STEP_BUCKETS, cumulative)],
                             stats.step_seconds.get(kind, 0.0))
        yield steps
        yield counter("pie_step_prompt_tokens", "Prompt tokens carried by the steps that carry any (cumulative).",
                      stats.step_prompt_tokens)
        yield counter("pie_steps_unbounded", "Steps with running decodes whose prompt tokens no stall bound limited "
                      "(--decode-stall-factor had no step times to go on yet).", stats.steps_unbounded)
        yield counter("pie_steps_stalled", "Steps with streamed decodes let past the stall bound to work off a backlog "
                      "of prompts (--decode-stall-share).", stats.steps_stalled)
        yield gauge("pie_stall_bound_fixed_seconds", "What the stall bound learnt carrying any prompt tokens adds "
                    "to a step (0 until measured).", stats.stall_fixed_s)
        yield gauge("pie_stall_bound_prompt_token_seconds", "What the stall bound learnt one prompt token adds to a "
                    "step (0 until measured).", stats.stall_prompt_token_s)
        yield gauge("pie_stall_bound_decode_ratio", "Measured decode-only steps over the stall bound's model of "
                    "them (CUDA graphs timed at start; 1 until measured).", stats.stall_decode_ratio)
        if stats.kv_host_blocks_total:
            yield from self._kv_tiers(stats, gauge)
        if self.max_loras:
            yield self._lora_info(stats)
        if self.num_speculative_tokens is not None:
            yield from self._spec_decode(stats, counter)

    def _kv_tiers(self, stats: EngineStats, gauge: Callable[[str, str, float], GaugeMetricFamily]):
        """The host and disk tiers below the KV pool (--kv-host-gib, --kv-disk-dir): their fill,
        and per tier the tokens read back into the pool, bytes moved and failures; the read-backs'
        time from lookup to the blocks joining the pool."""
        yield gauge("pie_kv_host_blocks", "KV blocks the host tier holds.", stats.kv_host_blocks_used)
        yield gauge("pie_kv_host_blocks_total", "KV blocks the host tier can hold.", stats.kv_host_blocks_total)
        yield gauge("pie_kv_disk_blocks", "KV blocks the disk tier holds.", stats.kv_disk_blocks_used)
        yield gauge("pie_kv_disk_bytes", "Bytes of the disk tier's files.", stats.kv_disk_bytes_used)
        yield gauge("pie_kv_disk_bytes_total", "The disk tier's budget in bytes.", stats.kv_disk_bytes_total)
        for name, doc, values in (
                ("pie_kv_tier_hit_tokens", "Prompt tokens read back into the KV pool from a tier below it.",
                 stats.kv_tier_hit_tokens),
                ("pie_kv_tier_read_bytes", "Bytes read back from a tier below the KV pool.", stats.kv_tier_read_bytes),
                ("pie_kv_tier_write_bytes", "Bytes written down into a tier below the KV pool.",
                 stats.kv_tier_write_bytes),
                ("pie_kv_tier_errors", "Failed reads and writes of a tier below the KV pool (a miss, or a block "
                 "kept only above).", stats.kv_tier_errors)):
            c = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
            for tier in ("host", "disk"):
                c.add_metric([self.model_name, tier], values.get(tier, 0))
            yield c
        s = SummaryMetricFamily("pie_kv_readback_seconds", "Read-backs from the host or disk tier: time from the "
                                "lookup to the blocks joining the KV pool.", labels=["model_name"])
        s.add_metric([self.model_name], stats.kv_readbacks, stats.kv_readback_seconds)
        yield s

    def _lora_info(self, stats: EngineStats) -> GaugeMetricFamily:
        """vLLM's `vllm:lora_requests_info`, as the Gateway API Inference Extension's model-server
        protocol defines it: one sample whose labels name the GPU slots (`max_lora`), the adapters
        loaded in GPU memory and ready to serve (`running_lora_adapters`) and those with requests
        waiting (`waiting_lora_adapters`), comma-separated; its value is when it was taken (the
        endpoint picker keeps the newest)."""
        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                              labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        g.add_metric([str(self.max_loras), ",".join(a.name for a in stats.adapters if a.resident),
                      ",".join(a.name for a in stats.adapters if a.waiting)], time.time())
        return g

    def _spec_decode(self, stats: EngineStats, counter: Callable[[str, str, float], CounterMetricFamily]):
        """vLLM v1's speculative-decoding counters, from the engine's cumulative counts."""
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", stats.spec_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      stats.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=["model_name", "position"])
        accepted = stats.spec_accepted_per_pos
        # K positions from the start (the engine's list grows as longer proposals are first made).
        for pos in range(max(self.num_speculative_tokens or 0, len(accepted))):
            per_pos.add_metric([self.model_name, str(pos)], accepted[pos] if pos < len(accepted) else 0)
        yield per_pos


class ServiceMetrics:
    """The server's metrics and (optionally) the HTTP endpoint that serves them on /metrics."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None] = lambda: None, *,
                 num_speculative_tokens: int | None = None, max_loras: int = 0,
                 cache_config: dict[str, str] | None = None) -> None:
        """`num_speculative_tokens`: K of `--speculative`; None when it is off (no spec_decode series).
        `max_loras`: LoRA slots (`--max-loras`); 0: no adapters (no lora series). `cache_config`:
        vllm:cache_config_info's labels besides num_gpu_blocks (block_size, cache_dtype)."""
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         m, registry=r)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       [*m, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", m, buckets=REQUEST_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", m,
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               m, buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", m,
                                                   buckets=TOKEN_BUCKETS, registry=r)
        # LoRA adapters: requests by adapter and outcome, and their tokens.
        self.adapter_requests = Counter("pie_adapter_requests", "Finished generation requests by LoRA adapter and "
                                        "gRPC status code.", [*m, "adapter", "code"], registry=r)
        self.adapter_prompt_tokens = Counter("pie_adapter_prompt_tokens", "Prefill tokens processed, by LoRA adapter.",
                                             [*m, "adapter"], registry=r)
        self.adapter_generation_tokens = Counter("pie_adapter_generation_tokens",
                                                 "Generation tokens processed, by LoRA adapter.", [*m, "adapter"],
                                                 registry=r)
        self.finished = Counter("pie_requests_finished", "Finished RPCs by method and gRPC status code.",
                                [*m, "rpc", "code"], registry=r)
        self.registry.register(_EngineCollector(model_name, stats, num_speculative_tokens, max_loras, cache_config))
        # Make the labelled series exist at 0 from the start, so rate() works from the first scrape.
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue_time,
                       self.request_prompt_tokens, self.request_generation_tokens):
            metric.labels(model_name)
        # The per-token series, labelled once (labels() takes a lock and a dict lookup per call).
        self._ttft, self._itl, self._queue_time = (h.labels(model_name) for h in (self.ttft, self.itl, self.queue_time))
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None

    # ---- observations (from the servicer, on the event loop) --------------------------------
    def first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def token_gap(self, gap_s: float, num_tokens: int) -> None:
        """`num_tokens` arrived together `gap_s` after the previous ones: one sample per token."""
        if num_tokens <= 0:
            return
        per_token = gap_s / num_tokens
        for _ in range(num_tokens):
            self._itl.observe(per_token)

    def queued(self, queue_time_s: float) -> None:
        self._queue_time.observe(queue_time_s)

    def request_finished(self, *, rpc: str, code: str, prompt_tokens: int | None = None,
                         generated_tokens: int = 0, finished_reason: str | None = None,
                         e2e_s: float | None = None, adapter: str | None = None) -> None:
        """Every RPC ends here once. Requests the engine served (prompt_tokens known) also count
        their tokens; those that reached a finish reason count in request_success; a LoRA
        adapter's requests and tokens count by adapter too."""
        self.finished.labels(self.model_name, rpc, code).inc()
        if adapter is not None:
            self.adapter_requests.labels(self.model_name, adapter, code).inc()
        if prompt_tokens is None:
            return
        name = self.model_name
        if adapter is not None:
            self.adapter_prompt_tokens.labels(name, adapter).inc(prompt_tokens)
            self.adapter_generation_tokens.labels(name, adapter).inc(generated_tokens)
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(generated_tokens)
        if finished_reason is not None:
            self.request_success.labels(name, finished_reason).inc()
            self.request_prompt_tokens.labels(name).observe(prompt_tokens)
            self.request_generation_tokens.labels(name).observe(generated_tokens)
        if e2e_s is not None:
            self.e2e.labels(name).observe(e2e_s)

    # ---- the HTTP endpoint -------------------------------------------------------------------
    def serve_http(self, host: str, port: int) -> int:
        """Serves /metrics (and nothing else: 404) on a daemon thread; returns the bound port
        (port 0 = any free port). Raises OSError when the address cannot be bound."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_MetricsServer", (_ThreadingWSGIServer,), {"address_family": family})
        self._http = make_server(host, port, _only_metrics_path(make_wsgi_app(self.registry)), server_class,
                                 handler_class=_QuietHandler)
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True)
        self._http_thread.start()
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A thread per scrape; daemon threads, so none is waited for at exit."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access-log line per scrape on stderr (the server's log is structlog's)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _only_metrics_path(app: Callable) -> Callable:
    """The WSGI app answers METRICS_PATH only: Prometheus' own handler serves every path, so a
    mistyped scrape target (or a probe of `/`) would look healthy."""

    def route(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"not found: metrics are served at {METRICS_PATH}\n".encode()]
        return app(environ, start_response)

    return route
