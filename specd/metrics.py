"""Prometheus metrics: the exporter every specd process runs, and the model services' own.

Each server owns its registry (tests run several servers in one process), and each process
serves it on its own HTTP port (`--metrics-port`). A model service counts and times every
call in a gRPC interceptor and tells the caller, in trailing metadata, how long it spent on
the call, so the orchestrator can split a step's wall time into draft, verify and network.
Sessions, cached tokens, queue depth and batch sizes are read from the model thread when
Prometheus scrapes. The orchestrator's metrics are in specd/orchestrator/metrics.py; the
README has the table of all of them.
"""

import time
from collections.abc import Mapping
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from specd.contract import SERVICE_SECONDS_KEY

disable_created_metrics()  # no `*_created` series: Prometheus tracks counter resets itself

# Seconds, from a fast GPU step to a slow CPU request.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def start_exporter(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve `registry` at http://host:port/metrics from a daemon thread; port 0 picks a free one
    (read it from `.server_port`). Stop it with `.shutdown()`."""
    server, _thread = start_http_server(port, host, registry)
    return server


class ServiceMetrics:
    """A draft or target service's metrics: calls by method and status, call seconds, and the
    model thread's state (sessions open, cached tokens, queue depth, batch sizes)."""

    def __init__(self, thread):
        self.registry = CollectorRegistry()
        self.calls = Counter("specd_service_calls", "Model-service calls answered, by method and status code",
                             ["method", "code"], registry=self.registry)
        self.call_seconds = Histogram(
            "specd_service_call_seconds", "Seconds a model-service call took inside the service (waiting for "
            "the model thread included), by method", ["method"], buckets=LATENCY_BUCKETS, registry=self.registry)
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
                context.set_trailing_metadata(((SERVICE_SECONDS_KEY, f"{time.perf_counter() - started:.6f}"),))
                return reply
            except BaseException:
                code = _status_name(context)
                raise
            finally:
                metrics.calls.labels(method, code).inc()
                metrics.call_seconds.labels(method).observe(time.perf_counter() - started)

        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


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
        store = self.thread.engine.store if self.thread.engine else None  # None while the model loads
        scheduler = self.thread.scheduler
        yield GaugeMetricFamily("specd_sessions_open", "Sessions this service holds a KV cache for",
                                value=len(store.sessions) if store else 0)
        yield GaugeMetricFamily("specd_cached_tokens", "Tokens in KV caches over all sessions",
                                value=store.cached_tokens if store else 0)
        yield GaugeMetricFamily("specd_queue_depth", "Calls waiting for the model thread", value=scheduler.queue_depth)
        yield _batch_histogram(_snapshot(scheduler.batch_sizes))


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
        "specd_batch_size", "Requests per forward pass of the model thread",
        buckets=buckets, sum_value=sum(size * n for size, n in passes_by_size.items()))
