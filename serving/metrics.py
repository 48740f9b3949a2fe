"""The model services' Prometheus metrics: calls by method and status, call seconds, and the
model thread's state, read when Prometheus scrapes (sessions, cached tokens, queue depth, batch
sizes; the prefix cache's hits, misses and evictions, and what it holds). A service tells the
caller, in trailing metadata, how long it spent on each call, so the orchestrator can split a
step's wall time into draft, verify and network.
"""

import time
from collections.abc import Mapping

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from specd.proto.contract import SERVICE_SECONDS_KEY
from specd.proto.metrics import LATENCY_BUCKETS
from specd.serving.messages import prefix_stats

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServiceMetrics:
    """A draft or target service's metrics: calls by method and status, call seconds, and the
    model thread's state (sessions open, cached tokens, queue depth, batch sizes)."""

    def __init__(self, thread):
        self.registry = CollectorRegistry()
        self.calls = Counter(
            "specd_service_calls",
            "Model-service calls answered, by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.call_seconds = Histogram(
            "specd_service_call_seconds",
            "Seconds a model-service call took inside the service (waiting for the model thread included), by method",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_ModelThreadCollector(thread))
        self.interceptor = _CallInterceptor(self)


class _CallInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times every unary call, and puts the seconds spent in trailing metadata."""

    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        behavior, metrics = handler.unary_unary, self.metrics

        async def timed(request, context):
            started = time.perf_counter()
            code = "OK"
            try:
                reply = await behavior(request, context)
                seconds = (SERVICE_SECONDS_KEY, f"{time.perf_counter() - started:.6f}")
                context.set_trailing_metadata((*(context.trailing_metadata() or ()), seconds))
                return reply
            except BaseException:
                code = _status_name(context)
                raise
            finally:
                metrics.calls.labels(method, code).inc()
                metrics.call_seconds.labels(method).observe(time.perf_counter() - started)

        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def _status_name(context) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "CANCELLED" if context.cancelled() else "UNKNOWN"


class _ModelThreadCollector:
    """Reads the model thread (its sessions, and its scheduler's queue and batch sizes) when scraped."""

    def __init__(self, thread):
        self.thread = thread

    def collect(self):
        store = self.thread.service.store if self.thread.service else None  # None while the model loads
        scheduler = self.thread.scheduler
        yield GaugeMetricFamily(
            "specd_sessions_open",
            "Sessions this service holds a KV cache for",
            value=len(store.sessions) if store else 0,
        )
        yield GaugeMetricFamily(
            "specd_cached_tokens", "Tokens in KV caches over all sessions", value=store.cached_tokens if store else 0
        )
        yield GaugeMetricFamily("specd_queue_depth", "Calls waiting for the model thread", value=scheduler.queue_depth)
        yield _batch_histogram(_snapshot(scheduler.batch_sizes))
        yield from _prefix_cache_families(prefix_stats(self.thread.service))


def _prefix_cache_families(stats):
    """The prefix cache (model/prefix_cache.py), read from its stats: what it saved, what it holds."""
    for name, documentation, value in (
        ("hit_tokens", "Prompt tokens new sessions took from the prefix cache instead of computing", stats.hit_tokens),
        ("miss_tokens", "Prompt tokens new sessions computed while the prefix cache was on", stats.miss_tokens),
        ("evictions", "Prefix-cache entries evicted for its budget or for room", stats.evictions),
        ("failures", "Prefix-cache copies not made or restored for want of memory: ran without", stats.failures),
        ("answers", "Finished chat requests whose answers the prefix cache kept for the next turn", stats.answers),
    ):
        yield CounterMetricFamily(f"specd_prefix_cache_{name}", documentation, value=value)
    for name, documentation, value in (
        ("entries", "Entries the prefix cache holds (each a copy of one prompt's leading blocks)", stats.entries),
        ("blocks", "Blocks (of BLOCK_TOKENS tokens) the prefix cache holds, over its entries", stats.blocks),
        ("tokens", "KV positions the prefix cache's copies hold (counted against its budget)", stats.tokens),
        ("bytes", "Memory the prefix cache's copies take, in bytes", stats.bytes),
        ("budget_tokens", "The prefix cache's budget in tokens (--prefix-cache-tokens; 0: off)", stats.budget_tokens),
    ):
        yield GaugeMetricFamily(f"specd_prefix_cache_{name}", documentation, value=value)


def _snapshot(counts: Mapping) -> dict:
    """A copy of a Counter the model thread may be updating (retry if it changed under us)."""
    for _ in range(10):
        try:
            return dict(counts)
        except RuntimeError:
            continue
    return {}


def _batch_histogram(passes_by_size: dict) -> HistogramMetricFamily:
    buckets = [(str(bound), sum(n for size, n in passes_by_size.items() if size <= bound)) for bound in BATCH_BUCKETS]
    buckets.append(("+Inf", sum(passes_by_size.values())))
    return HistogramMetricFamily(
        "specd_batch_size",
        "Requests per forward pass of the model thread",
        buckets=buckets,
        sum_value=sum(size * n for size, n in passes_by_size.items()),
    )
