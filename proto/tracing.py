"""OpenTelemetry traces, off unless a process is given an OTLP endpoint (`--otlp-endpoint`).

Off (the default) nothing is set up: the SDK is not imported, no tracer provider or exporter
exists, `span()` is a shared null context, and gRPC calls carry no trace context.

On (`setup(endpoint, service)`), the process gets a tracer provider that sends its spans in batches
over OTLP/gRPC, and every grpc.aio server and channel it creates from then on makes a span per
specd.v1 call and carries the W3C trace context (`traceparent`) in the call's metadata
(opentelemetry-instrumentation-grpc). So one request is one trace:
  1. the orchestrator's server span of SpecDecode/Generate, in the server process (over HTTP: the
     span of `POST /v1/completions` or `/v1/chat/completions`, opentelemetry-instrumentation-asgi,
     which also continues a `traceparent` header the client sends);
  2. the request span (`specd.request`), in the Ray worker that runs the request: the context gets
     there as a carrier dict (`carrier()` in the server process, `parent()` in the worker), with a
     `step` span per step, each with its `propose` and `verify` (or `decode`) calls;
  3. each service's server span of Propose, Verify or Decode, a child of the worker's client span.
Every process of a stack calls `setup` itself (the Ray workers too: they are other processes).
Attributes are named `specd.<field>` after the proto's fields and the glossary's words.
"""

import contextlib
import os

from opentelemetry import propagate, trace

TRACED_SERVICES = "specd.v1."  # gRPC spans for specd's own calls only (not health, reflection, Ray's)
# The SDK sends a batch every 5 s by default; a second shows a request's trace while it is looked
# for. OTEL_BSP_SCHEDULE_DELAY (milliseconds), where set, wins.
EXPORT_DELAY_MS = 1000

_tracer: trace.Tracer | None = None  # set while tracing is on in this process
_provider = None  # its TracerProvider
_instrumentors: tuple = ()
_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def setup(endpoint: str | None, service: str) -> bool:
    """Trace this process to the OTLP/gRPC collector at `endpoint` (`http://host:4317`; `https://` for
    TLS; a bare host:port means http), as `service` (the spans' service.name). Without an endpoint,
    or when tracing is already on here, does nothing. Returns whether tracing is on."""
    if not endpoint or _tracer is not None:
        return _tracer is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    delay = None if "OTEL_BSP_SCHEDULE_DELAY" in os.environ else EXPORT_DELAY_MS
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=delay))
    install(provider)
    return True


def install(provider) -> None:
    """Trace with `provider` (an SDK TracerProvider) from now on: specd's spans, and the spans and
    context propagation of the grpc.aio servers and channels created after this call. `setup` calls
    it; a test calls it with a provider of its own (an in-memory exporter)."""
    global _tracer, _provider, _instrumentors
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
    from opentelemetry.instrumentation.grpc.filters import service_prefix

    _tracer, _provider = provider.get_tracer("specd"), provider
    only_specd = service_prefix(TRACED_SERVICES)
    _instrumentors = (GrpcAioInstrumentorServer(filter_=only_specd), GrpcAioInstrumentorClient(filter_=only_specd))
    for instrumentor in _instrumentors:
        instrumentor.instrument(tracer_provider=provider)


def uninstall() -> None:
    """Tracing off again: servers and channels created from now on are plain (a test's cleanup)."""
    global _tracer, _provider, _instrumentors
    for instrumentor in _instrumentors:
        instrumentor.uninstrument()
    _tracer, _provider, _instrumentors = None, None, ()


def traced_asgi(app, untraced: str = ""):
    """An ASGI app with a server span per HTTP request (continuing a client's `traceparent` header), made
    current for the whole request, a streamed body's too, so the request's spans are its children; the
    app itself when tracing is off. `untraced`: paths without spans, comma-separated (`/health,/metrics`)."""
    if _tracer is None:
        return app
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    return OpenTelemetryMiddleware(
        app, excluded_urls=untraced, tracer_provider=_provider, exclude_spans=["receive", "send"]
    )


def enabled() -> bool:
    return _tracer is not None


def carrier() -> dict[str, str]:
    """The current trace context as a dict (W3C `traceparent`), to hand to another process; {} when off."""
    if _tracer is None:
        return {}
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


def parent(headers: dict[str, str] | None):
    """The trace context `carrier()` made, in the process that continues the trace; None when off or empty."""
    if _tracer is None or not headers:
        return None
    return propagate.extract(headers)


def start_span(name: str, context=None, **attributes):
    """A span that is not made current, for one that outlives a task (a request's, across the yields
    of its generator); the caller end()s it. `context`: the parent's (`parent()`), else a new trace."""
    if _tracer is None:
        return trace.INVALID_SPAN
    return _tracer.start_span(name, context=context, attributes=_named(attributes))


def span(name: str, parent_span=None, **attributes):
    """`with span("verify", k=3):` a span around a block, current inside it (so the gRPC calls made
    there are its children): a child of `parent_span` (a span from start_span), else of the current one."""
    if _tracer is None:
        return _NO_SPAN
    context = None if parent_span is None else trace.set_span_in_context(parent_span)
    return _tracer.start_as_current_span(name, context=context, attributes=_named(attributes))


def current(span_):
    """`with current(request_span):` makes a span from start_span current for a block (it is not ended)."""
    if _tracer is None:
        return _NO_SPAN
    return trace.use_span(span_, end_on_exit=False)


def annotate(span_=None, /, **attributes) -> None:
    """Set attributes on `span_`, else on the current span (a step's, inside its `with span`)."""
    if _tracer is not None:
        (span_ or trace.get_current_span()).set_attributes(_named(attributes))


def _named(attributes: dict) -> dict:
    return {f"specd.{key}": value for key, value in attributes.items()}
