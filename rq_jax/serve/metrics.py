"""Prometheus metrics of a serving engine (prometheus-client, on a registry of its own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Latency buckets (seconds) from a millisecond to a minute.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "rq_serve_"
#: The engine's programs, as `ServeMetrics.ran` counts them.
PHASES = ("prefill", "decode")
#: HTTP statuses of requests refused when submitted, as `ServeMetrics.refused` counts them.
REFUSALS = (400, 429, 503)


class ServeMetrics:
    """Gauges of the engine's state, counters of tokens and requests, latency histograms.

    running / waiting requests, decode rows used / at most, pages used / total (and the tokens they hold),
    cache bytes of the used pages and what a dense bf16 cache would take for their tokens, prefix-cache tokens
    looked up and found, preemptions, prompt / generated tokens, finished requests by reason, values the cache
    could not store (`KVCache.out_of_range` of each step), time to first token, inter-token latency and
    end-to-end latency; the engine's wall seconds and calls per program (`phase`: prompt chunks, decode
    steps), which tell what bounds its throughput.
    """

    def __init__(self, model_name: str, cache_format: str):
        self.registry = CollectorRegistry()
        labels = dict(labelnames=("model", "cache"), registry=self.registry)
        self._labels = dict(model=model_name, cache=cache_format)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, **labels).labels(**self._labels)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, **labels).labels(**self._labels)

        def histogram(name, doc):
            return Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, **labels).labels(**self._labels)

        self.running = gauge("requests_running", "requests holding a decode slot (prefill included)")
        self.waiting = gauge("requests_waiting", "requests queued for a slot")
        self.slots_used = gauge("slots_used", "requests decoding (rows of the decode step)")
        self.slots_total = gauge("slots_total", "requests that may decode at once")
        self.pages_used = gauge("pages_used", "cache pages held by requests")
        self.pages_total = gauge("pages_total", "cache pages in the pool")
        self.capacity_tokens = gauge("cache_capacity_tokens", "tokens the pool's pages hold")
        self.cache_bytes = gauge("cache_bytes_in_use", "KV cache bytes of the held pages (the arrays' own bytes)")
        self.dense_bytes = gauge("cache_dense_bf16_equivalent_bytes",
                                 "what a dense bf16 cache would take for the tokens the requests hold")
        self.prefix_queries = gauge("prefix_cache_queried_tokens", "prompt tokens looked up in the prefix index")
        self.prefix_hits = gauge("prefix_cache_hit_tokens", "prompt tokens whose pages the prefix index shared")
        self.preemptions = counter("preemptions", "requests that gave their pages back to be recomputed")
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens prefilled")
        self.generated_tokens = counter("generation_tokens", "tokens generated")
        self.out_of_range = counter("cache_out_of_range_values",
                                    "values the cache could not store (metadata out of range, non-finite K/V)")
        self._finished = Counter(PREFIX + "requests_finished", "finished requests by reason",
                                 labelnames=("model", "cache", "reason"), registry=self.registry)
        for reason in ("stop", "length", "cancelled"):  # exported at 0 from the start
            self._finished.labels(**self._labels, reason=reason)
        self._refused = Counter(PREFIX + "requests_refused", "requests refused when submitted, by HTTP status "
                                "(400 a parameter the engine cannot serve, 429 the queue full, 503 not ready)",
                                labelnames=("model", "cache", "status"), registry=self.registry)
        for status in REFUSALS:
            self._refused.labels(**self._labels, status=str(status))
        self._engine_seconds = Counter(PREFIX + "engine_seconds", "engine wall seconds by program, results ready",
                                       labelnames=("model", "cache", "phase"), registry=self.registry)
        self._engine_calls = Counter(PREFIX + "engine_calls", "engine program calls by program",
                                     labelnames=("model", "cache", "phase"), registry=self.registry)
        for phase in PHASES:
            self._engine_seconds.labels(**self._labels, phase=phase)
            self._engine_calls.labels(**self._labels, phase=phase)
        self.decode_rows = counter("decode_rows", "rows the decode steps ran over (their sum: ÷ decode calls is "
                                   "the mean step size)")
        self.ttft = histogram("time_to_first_token_seconds", "arrival to first token")
        self.itl = histogram("inter_token_latency_seconds", "time between a request's consecutive tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "arrival to last token")

    def finished(self, reason: str) -> None:
        """Count a finished request (reason: stop, length, cancelled)."""
        self._finished.labels(**self._labels, reason=reason).inc()

    def refused(self, status: int) -> None:
        """Count a request refused when submitted (one of `REFUSALS`)."""
        self._refused.labels(**self._labels, status=str(status)).inc()

    def ran(self, phase: str, seconds: float) -> None:
        """Count one call of an engine program (one of `PHASES`) and its wall seconds."""
        self._engine_seconds.labels(**self._labels, phase=phase).inc(seconds)
        self._engine_calls.labels(**self._labels, phase=phase).inc()

    def pool(self, scheduler, *, max_rows: int, pages: int, page_size: int, page_bytes: int,
             dense_token_bytes: int) -> None:
        """Set the gauges of an engine's `scheduler` (`rq_jax.serve.scheduler.Scheduler`) over a pool of `pages`
        pages of `page_size` tokens and `page_bytes` bytes, at most `max_rows` decoding; `dense_token_bytes`:
        one token's K/V in dense bf16."""
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.slots_used.set(len(scheduler.running))
        self.slots_total.set(max_rows)
        self.pages_used.set(scheduler.pool.held)
        self.pages_total.set(pages)
        self.capacity_tokens.set(pages * page_size)
        self.cache_bytes.set(scheduler.pool.held * page_bytes)
        self.dense_bytes.set(scheduler.tokens_held() * dense_token_bytes)
        self.prefix_queries.set(scheduler.prefix_queries)
        self.prefix_hits.set(scheduler.prefix_hits)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
