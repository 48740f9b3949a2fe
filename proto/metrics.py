"""Prometheus plumbing every specd process shares (no torch): latency buckets and the exporter.

Each server owns its registry (tests run several servers in one process), and each process
serves it on its own HTTP port (`--metrics-port`). The model services' metrics are in
serving/metrics.py, the orchestrator's in orchestrator/metrics.py; docs/operating/observability.md has
the table of all of them.
"""

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

disable_created_metrics()  # no `*_created` series: Prometheus tracks counter resets itself

# Seconds, from a fast GPU step to a slow CPU request.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def start_exporter(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve `registry` at http://host:port/metrics from a daemon thread; port 0 picks a free one
    (read it from `.server_port`). Stop it with `.shutdown()`."""
    server, _thread = start_http_server(port, host, registry)
    return server
