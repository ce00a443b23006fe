"""Prometheus metrics, named in vLLM's style with a ``ferrox:`` prefix.

What the pool knows (blocks free, used and cached, the usage ratio, prefix
hits) is read from ``pool.stats()`` at each scrape, never counted twice; the
engine counts what only it sees (requests, tokens, latencies, refusals).

=========================================  =========  ===========================================
name                                       type       meaning
=========================================  =========  ===========================================
ferrox:kv_cache_usage_perc                 gauge      used blocks / total blocks (0..1)
ferrox:kv_blocks_free / _used / _cached    gauge      the pool's blocks (cached: published, held
                                                      by no one, part of free)
ferrox:prefix_cache_queries_total          counter    prompt tokens looked up in the prefix cache
ferrox:prefix_cache_hits_total             counter    of those, tokens reused (the pool's count)
ferrox:num_requests_running / _waiting     gauge      admitted (holding a reservation) / queued
ferrox:request_refused_total{reason}       counter    503s (queue_full, queue_timeout,
                                                      shutting_down) and 400s (never_fits)
ferrox:request_success_total{finished_reason}  counter  requests that ended (stop, length)
ferrox:request_cancelled_total{where}      counter    client went away (queued, running)
ferrox:num_preemptions_total               counter    always 0: reservations make decode
                                                      infallible, nothing is ever preempted
ferrox:time_to_first_token_seconds         histogram  arrival to the first token
ferrox:inter_token_latency_seconds         histogram  between a request's tokens
ferrox:e2e_request_latency_seconds         histogram  arrival to the end
ferrox:decode_batch_size                   histogram  sequences per decode forward
ferrox:prompt_tokens_total                 counter    prompt tokens of admitted requests
ferrox:generation_tokens_total             counter    tokens generated
=========================================  =========  ===========================================
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Metrics"]

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class _PoolCollector:
    def __init__(self, metrics):
        self.m = metrics

    def collect(self):
        s = self.m.pool.stats()
        total = s["total_blocks"] or 1
        yield GaugeMetricFamily("ferrox:kv_cache_usage_perc",
                                "KV-cache usage: used blocks / total blocks (0..1)",
                                value=s["used_blocks"] / total)
        yield GaugeMetricFamily("ferrox:kv_blocks_free", "Free blocks (cached ones included)",
                                value=s["free_blocks"])
        yield GaugeMetricFamily("ferrox:kv_blocks_used", "Blocks held by requests",
                                value=s["used_blocks"])
        yield GaugeMetricFamily("ferrox:kv_blocks_cached",
                                "Published prefix blocks held by no request",
                                value=s["cached_blocks"])
        yield CounterMetricFamily("ferrox:prefix_cache_hits", "Prompt tokens reused from the "
                                  "prefix cache", value=s.get("hit_tokens", 0))
        yield CounterMetricFamily("ferrox:prefix_cache_queries", "Prompt tokens looked up in the "
                                  "prefix cache", value=self.m.prefix_queries)
        engine = self.m.engine
        if engine is not None:
            st = engine.stats()
            yield GaugeMetricFamily("ferrox:num_requests_running",
                                    "Requests holding a reservation", value=st["running"])
            yield GaugeMetricFamily("ferrox:num_requests_waiting", "Requests in the queue",
                                    value=st["waiting"])


class Metrics:
    """The server's registry; ``render()`` is the text exposition format."""

    def __init__(self, pool):
        self.pool = pool
        self.engine = None
        self.prefix_queries = 0
        self.registry = r = CollectorRegistry()
        r.register(_PoolCollector(self))
        self._refused = Counter("ferrox:request_refused", "Requests refused, by reason",
                                ["reason"], registry=r)
        self._success = Counter("ferrox:request_success", "Requests that ended",
                                ["finished_reason"], registry=r)
        self._cancelled = Counter("ferrox:request_cancelled", "Requests whose client went away",
                                  ["where"], registry=r)
        self._preempt = Counter("ferrox:num_preemptions", "Preemptions (never: reservations)",
                                registry=r)
        self._ttft = Histogram("ferrox:time_to_first_token_seconds", "Arrival to first token",
                               buckets=_LATENCY, registry=r)
        self._itl = Histogram("ferrox:inter_token_latency_seconds", "Between tokens",
                              buckets=_LATENCY, registry=r)
        self._e2e = Histogram("ferrox:e2e_request_latency_seconds", "Arrival to end",
                              buckets=_LATENCY, registry=r)
        self._batch = Histogram("ferrox:decode_batch_size", "Sequences per decode forward",
                                buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self._prompt = Counter("ferrox:prompt_tokens", "Prompt tokens of admitted requests",
                               registry=r)
        self._gen = Counter("ferrox:generation_tokens", "Tokens generated", registry=r)
        for reason in ("queue_full", "queue_timeout", "shutting_down", "never_fits"):
            self._refused.labels(reason)
        for where in ("queued", "running"):
            self._cancelled.labels(where)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- what the engine reports -----------------------------------------------

    def refused(self, reason):
        self._refused.labels(reason).inc()

    def event(self, what):
        if what.startswith("cancelled_"):
            self._cancelled.labels(what[len("cancelled_"):]).inc()

    def admitted(self, r):
        n = len(r.prompt_ids)
        self._prompt.inc(n)
        if self.pool.prefix_cache:
            self.prefix_queries += n

    def first_token(self, r, seconds):
        self._ttft.observe(seconds)

    def inter_token(self, seconds):
        self._itl.observe(seconds)

    def decode_batch(self, n):
        self._batch.observe(n)

    def finished(self, r, seconds):
        self._success.labels(r.finish_reason).inc()
        self._gen.inc(len(r.output_ids))
        self._e2e.observe(seconds)
