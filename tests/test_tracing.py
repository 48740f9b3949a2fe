"""OpenTelemetry traces (proto/tracing.py): one request through a real tiny stack is one trace over
the orchestrator, the Ray worker that ran it and both services; with tracing off nothing is set up.

The services and the orchestrator's server run in this process, traced with an in-memory exporter;
the Ray worker is another process and traces itself as production does: it is given an OTLP
endpoint, a small OTLP/gRPC collector in this test.
"""

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from conftest import start_services
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specd.orchestrator.server import OrchestratorServer
from specd.proto import tracing
from specd.proto.limits import Limits
from specd.v1 import common_pb2, specdecode_pb2, specdecode_pb2_grpc

PROMPT = "def quicksort(arr):"
HTTP_TRACE_ID, HTTP_PARENT_ID = 0x5EC0_0000_0000_0000_0000_0000_0000_0001, 0x0BAD_CAFE_0000_0001
MAX_NEW_TOKENS = 8


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self):
        self.spans = []  # opentelemetry.proto.trace.v1 Span messages

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def attributes(span) -> dict:
    """An OTLP span's attributes as a dict."""
    return {item.key: getattr(item.value, item.value.WhichOneof("value")) for item in span.attributes}


def message(k: int) -> specdecode_pb2.GenerateRequest:
    return specdecode_pb2.GenerateRequest(
        prompt=PROMPT,
        max_new_tokens=MAX_NEW_TOKENS,
        draft_tokens=k,
        drafter="model",
        ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0),
    )


async def generate(stub, request) -> tuple[list[int], specdecode_pb2.Final]:
    tokens, final = [], None
    async for reply in stub.Generate(request):
        if reply.HasField("delta"):
            tokens += reply.delta.token_ids
        else:
            final = reply.final
    return tokens, final


def read_events(request: urllib.request.Request) -> tuple[int, list[str]]:
    """An HTTP request's status and its body's server-sent `data:` lines."""
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, [line for line in response.read().decode().splitlines() if line.startswith("data: ")]


@pytest.fixture
async def collector():
    server = grpc.aio.server()  # before tracing is installed: the collector's own calls are not traced
    receiver = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    await server.stop(0)


@pytest.fixture
def in_memory():
    """Tracing on in this process, into an in-memory exporter; off again afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.uninstall()
    provider.shutdown()


async def test_one_request_is_one_trace_over_orchestrator_worker_and_both_services(
    tiny_loaded, ray_local, collector, in_memory
):
    receiver, endpoint = collector
    services = await start_services(tiny_loaded["draft"], tiny_loaded["target"], Limits(max_sessions=8))
    orchestrator = OrchestratorServer(
        f"127.0.0.1:{services.draft_server.port}",
        f"127.0.0.1:{services.target_server.port}",
        workers=1,
        otlp_endpoint=endpoint,
    )
    await orchestrator.start("127.0.0.1:0")
    http_port = await orchestrator.start_http()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}")
    try:
        tokens, final = await generate(specdecode_pb2_grpc.SpecDecodeStub(channel), message(k=3))
        # Over HTTP, streamed, continuing the client's own trace (W3C traceparent).
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
        headers = {
            "traceparent": f"00-{HTTP_TRACE_ID:032x}-{HTTP_PARENT_ID:016x}-01",
            "Content-Type": "application/json",
        }
        base = f"http://127.0.0.1:{http_port}"
        post = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), headers)
        status, streamed = await asyncio.to_thread(read_events, post)
        assert (await asyncio.to_thread(read_events, urllib.request.Request(f"{base}/health")))[0] == 200
        deadline = time.monotonic() + 20  # the worker sends its spans in batches, about every second
        while sum(span.name == "specd.request" for span in receiver.spans) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        await channel.close()
        await orchestrator.stop(0)
        await services.close()
    assert len(tokens) == MAX_NEW_TOKENS and final.stats.drafted > 0

    # This process: the client's call, the orchestrator's server span, and the services' server spans.
    generates = [s for s in in_memory.get_finished_spans() if s.name == "/specd.v1.SpecDecode/Generate"]
    (client,) = [s for s in generates if s.kind == trace.SpanKind.CLIENT]
    (served,) = [s for s in generates if s.kind == trace.SpanKind.SERVER]
    trace_id = client.context.trace_id
    here = [s for s in in_memory.get_finished_spans() if s.context.trace_id == trace_id]
    assert served.parent.span_id == client.context.span_id
    # The worker (another process): the request, its steps, their propose / verify calls.
    worker = [s for s in receiver.spans if int.from_bytes(s.trace_id, "big") == trace_id]
    by_id = {s.span_id: s for s in worker}
    (request,) = [s for s in worker if s.name == "specd.request"]
    assert int.from_bytes(request.parent_span_id, "big") == served.context.span_id
    request_attributes = attributes(request)
    session_id = request_attributes["specd.session_id"]
    assert len(session_id) == 32
    assert request_attributes["specd.drafter"] == "model"
    assert request_attributes["specd.max_new_tokens"] == MAX_NEW_TOKENS
    assert request_attributes["specd.completion_tokens"] == MAX_NEW_TOKENS
    assert request_attributes["specd.finish_reason"] == "length"

    steps = sorted((s for s in worker if s.name == "step"), key=lambda s: s.start_time_unix_nano)
    assert len(steps) == final.stats.steps
    assert all(s.parent_span_id == request.span_id for s in steps)
    step_attributes = [attributes(s) for s in steps]
    assert all(a["specd.session_id"] == session_id for a in step_attributes)
    assert [a["specd.k"] for a in step_attributes] == list(final.stats.draft_lengths)
    assert sum(a["specd.accepted"] for a in step_attributes) == final.stats.accepted
    assert all(a["specd.network_seconds"] >= 0 and a["specd.verify_seconds"] > 0 for a in step_attributes)
    step_ids = {s.span_id for s in steps}
    proposes = [s for s in worker if s.name == "propose"]
    verifies = [s for s in worker if s.name in ("verify", "decode")]
    assert len(proposes) == final.stats.drafting_steps and len(verifies) == final.stats.steps
    assert all(s.parent_span_id in step_ids for s in proposes + verifies)

    # Each service's span of a call is a child of the worker's client span, itself inside a propose or verify span.
    for method, parents in (("DraftService/Propose", proposes), ("TargetService/Verify", verifies)):
        service_spans = [s for s in here if s.name == f"/specd.v1.{method}" and s.kind == trace.SpanKind.SERVER]
        assert len(service_spans) == final.stats.drafting_steps, method
        for span in service_spans:
            calling = by_id[span.parent.span_id.to_bytes(8, "big")]
            assert calling.name == f"/specd.v1.{method}" and calling.kind == calling.SPAN_KIND_CLIENT
            assert calling.parent_span_id in {p.span_id for p in parents}
    # The first step is the target's alone (a Decode carrying the prompt); Release closes the request.
    assert any(s.name == "/specd.v1.TargetService/Decode" for s in here)
    assert {"/specd.v1.DraftService/Release", "/specd.v1.TargetService/Release"} <= {s.name for s in here}

    # HTTP: the handler's server span continues the client's trace and is the parent of the worker's request span.
    assert status == 200 and streamed[-1] == "data: [DONE]"
    (posted,) = [s for s in in_memory.get_finished_spans() if s.name == "POST /v1/completions"]
    assert posted.kind == trace.SpanKind.SERVER and posted.context.trace_id == HTTP_TRACE_ID
    assert posted.parent.span_id == HTTP_PARENT_ID
    (http_request,) = [s for s in receiver.spans if int.from_bytes(s.trace_id, "big") == HTTP_TRACE_ID
                       and s.name == "specd.request"]  # fmt: skip
    assert int.from_bytes(http_request.parent_span_id, "big") == posted.context.span_id
    assert attributes(http_request)["specd.completion_tokens"] == 4
    assert not [s for s in in_memory.get_finished_spans() if "/health" in s.name]  # health checks are not traced


async def test_tracing_off_sets_up_nothing_and_records_no_spans(tiny_stack):
    """The session's stack runs without --otlp-endpoint: no provider, no exporter, no spans, here and
    in its Ray workers; a fresh interpreter of the orchestrator and the CLI does not even import the SDK."""
    tokens, final = await generate(tiny_stack.client, message(k=3))
    assert len(tokens) == MAX_NEW_TOKENS
    assert not tracing.enabled() and tracing.carrier() == {} and tracing.parent({"traceparent": "x"}) is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # nobody set one
    assert not trace.get_current_span().is_recording()
    with tracing.span("step", k=1) as span:
        assert not span.is_recording()

    def worker_state(actor):  # runs in the Ray worker's process
        import sys

        from opentelemetry import trace

        from specd.proto import tracing

        sdk = sorted(name for name in sys.modules if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")))
        return tracing.enabled(), type(trace.get_tracer_provider()).__name__, sdk

    for actor in tiny_stack.orchestrator.pool.actors:
        assert await actor.__ray_call__.remote(worker_state) == (False, "ProxyTracerProvider", [])

    fresh = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=120, cwd="/")
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout.splitlines()[-1]) == {"on": False, "sdk": []}


# An orchestrator's modules and `specd serve` / `specd up` parsed without --otlp-endpoint, then set up.
FRESH_PROCESS = r"""
import json, sys
import specd.orchestrator.server, specd.orchestrator.worker, specd.deploy.local
from specd.cli import build_parser
from specd.proto import tracing
on = False
for argv in (["serve", "orchestrator", "--draft", "a:1", "--target", "b:2"], ["serve", "draft"], ["up"]):
    on = on or tracing.setup(build_parser().parse_args(argv).otlp_endpoint, "specd-test")
sdk = sorted(name for name in sys.modules if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                                              "opentelemetry.instrumentation")))
print(json.dumps({"on": on, "sdk": sdk}))
"""
