"""A cluster stack (`specd up --ray-address`) as locked down as `specd serve`: the token (from
SPECD_TOKEN), TLS, the limits and tracing reach every Ray actor, and the token reaches no command line.

One deployment, shared by every test here: a loopback lab (one Ray node offering the three roles, as
tests/test_cluster.py runs it), tiny random models, `specd up` as a user runs it, with a self-signed
certificate for this machine's addresses and a small OTLP collector (tests/test_tracing.py's).
"""

import asyncio
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from test_auth import status_of
from test_openai_api import http
from test_tracing import Collector, attributes

from specd.cli import build_parser
from specd.cli.common import UserError
from specd.deploy.lab import Lab, LabConfig
from specd.deploy.local import free_port
from specd.proto.auth import TOKEN_ENV, ClientSecurity
from specd.v1 import specdecode_pb2, specdecode_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

PROMPT = "def quicksort(arr):"
LIMITS = {"--max-draft-tokens": 5, "--max-session-tokens": 600, "--max-prompt-tokens": 64}
INFO = {  # one method per server, called with a missing or wrong token
    "orchestrator-0": "/specd.v1.SpecDecode/Info",
    "draft": "/specd.v1.DraftService/Info",
    "target": "/specd.v1.TargetService/Info",
}


class ServiceCollector(Collector):
    """tests/test_tracing.py's OTLP receiver, also keeping which service (service.name) sent each span."""

    def __init__(self):
        super().__init__()
        self.sent_by: dict[bytes, str] = {}  # span id -> service.name

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = attributes(resource_spans.resource).get("service.name")
            for scope_spans in resource_spans.scope_spans:
                self.sent_by.update((span.span_id, service) for span in scope_spans.spans)
        return await super().Export(request, context)


def self_signed(folder: Path, ips: list[str]) -> tuple[Path, Path]:
    """A certificate for `ips` (it is its own CA), made with the openssl CLI as tests/test_auth.py does."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    names = ",".join(["DNS:localhost", *(f"IP:{ip}" for ip in ips)])
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost"]
        + ["-addext", f"subjectAltName={names}", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
async def cluster(tiny_dirs, tmp_path_factory):
    """`specd up --ray-address` with SPECD_TOKEN, --tls-cert/--tls-key, LIMITS and --otlp-endpoint."""
    import ray

    token = f"cluster-{secrets.token_hex(16)}"
    cert, key = self_signed(tmp_path_factory.mktemp("tls"), ["127.0.0.1", ray.util.get_node_ip_address()])
    receiver = ServiceCollector()
    collector = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    otlp_port = collector.add_insecure_port("127.0.0.1:0")
    await collector.start()
    http_port = free_port()
    lab = Lab(LabConfig(namespaces=False))
    try:
        await lab.start()
        ports = {flag: str(free_port()) for flag in ("--port", "--draft-port", "--target-port", "--metrics-port")}
        ports |= {flag: str(free_port()) for flag in ("--draft-metrics-port", "--target-metrics-port")}
        argv = [sys.executable, "-m", "specd.cli", "up", "--ray-address", lab.head_address, "--dtype", "float32"]
        argv += ["--draft-model", str(tiny_dirs["draft"]), "--target-model", str(tiny_dirs["target"])]
        argv += [item for flag, value in ports.items() for item in (flag, value)]
        argv += ["--http-port", str(http_port), "--tls-cert", str(cert), "--tls-key", str(key)]
        argv += ["--otlp-endpoint", f"http://127.0.0.1:{otlp_port}", "--workers", "1"]
        argv += [item for flag, value in LIMITS.items() for item in (flag, str(value))]
        # as the lab's own deployments run (deploy/lab.py): Ray's token auth on, RAY_ADDRESS not inherited
        env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
        env |= {"PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "token", TOKEN_ENV: token}
        log = lab.workdir / "specd-up.log"
        lab.up = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=log.open("w"),
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # lab.stop() ends its process group
        )
        await lab._read_deployment(log)  # the address lines, up to `ready:`
        yield {
            "deployed": lab.deployed,
            "address": lab.deployed["orchestrator-0"][0],
            "http": f"https://{lab.deployed['orchestrator-0'][0].rsplit(':', 1)[0]}:{http_port}",
            "token": token,
            "ca": cert.read_bytes(),
            "up_pid": lab.up.pid,
            "collector": receiver,
        }
    finally:
        await lab.stop()
        await collector.stop(0)


def generate(cluster, security: ClientSecurity, **fields):
    """One Generate call's replies (an awaitable list) to the cluster's orchestrator."""
    request = specdecode_pb2.GenerateRequest(
        **{"prompt": PROMPT, "max_new_tokens": 12, "ignore_eos": True, "drafter": "model", **fields}
    )

    async def replies(metadata=None):
        async with security.channel(cluster["address"]) as channel:
            stub = specdecode_pb2_grpc.SpecDecodeStub(channel)
            return [reply async for reply in stub.Generate(request, timeout=120, metadata=metadata)]

    return replies


def tokens(replies) -> list[int]:
    return [token for reply in replies if reply.HasField("delta") for token in reply.delta.token_ids]


async def test_no_port_serves_a_call_without_the_token_but_health(cluster):
    ca = cluster["ca"]
    for name, method in INFO.items():
        address = cluster["deployed"][name][0]
        for security, says in [
            (ClientSecurity(None, ca), "no `authorization: Bearer <token>` metadata"),
            (ClientSecurity("wrong", ca), "the bearer token is wrong"),
        ]:
            async with security.channel(address) as channel:
                code, details = await status_of(channel.unary_unary(method)(b"", timeout=10))
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, details)
            assert says in details
        async with ClientSecurity(None, ca).channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async with ClientSecurity(cluster["token"]).channel(address) as channel:  # plaintext to a TLS port
            code, _ = await status_of(channel.unary_unary(method)(b"", timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
    code, _ = await status_of(generate(cluster, ClientSecurity(None, ca))())
    assert code == grpc.StatusCode.UNAUTHENTICATED

    trusted = ssl.create_default_context(cadata=ca.decode())  # the HTTP API: the same token, the same TLS
    status, _ = await http("GET", f"{cluster['http']}/v1/models", context=trusted)
    assert status == 401
    bearer = {"Authorization": f"Bearer {cluster['token']}"}
    status, _ = await http("GET", f"{cluster['http']}/v1/models", headers=bearer, context=trusted)
    assert status == 200


async def test_the_token_over_tls_generates_exact_greedy_output(cluster):
    security = ClientSecurity(cluster["token"], cluster["ca"])
    target_only = await generate(cluster, security, draft_tokens=0)()
    speculative = await generate(cluster, security, draft_tokens=4)()
    assert len(tokens(target_only)) == 12
    assert tokens(speculative) == tokens(target_only)
    assert speculative[-1].final.stats.drafted > 0  # the orchestrator reached the draft with its token and CA


async def test_the_limits_reach_the_orchestrator_and_both_services(cluster):
    security = ClientSecurity(cluster["token"], cluster["ca"])
    for fields, says in [
        ({"prompt": "x = 1\n" * 40}, "at most 64 (--max-prompt-tokens)"),  # the orchestrator's own limit
        ({"max_new_tokens": 1000}, "exceeds the 600 tokens a session may hold"),  # the services' ModelInfo
        ({"draft_tokens": 6}, "above the largest the services accept (5)"),
    ]:
        code, details = await status_of(generate(cluster, security, **fields)())
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert says in details


def test_the_token_is_on_no_command_line(cluster):
    """Not on any process's command line (`ps -ef`), the actors' own included; it is in `specd up`'s
    environment only, where SPECD_TOKEN put it."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    command_lines = {}
    for pid in pids:
        try:
            command_lines[pid] = (Path(f"/proc/{pid}") / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            continue
    actors = [pid for _, pid in cluster["deployed"].values()]
    assert all(pid in command_lines for pid in actors)  # the scan saw every actor
    assert not [pid for pid, line in command_lines.items() if cluster["token"] in line]
    environment = (Path(f"/proc/{cluster['up_pid']}") / "environ").read_bytes()
    assert f"{TOKEN_ENV}={cluster['token']}".encode() in environment.split(b"\0")


async def test_every_actor_traces_one_request_into_one_trace(cluster):
    """The trace the client starts (`traceparent`) spans the orchestrator actor, its Ray worker and both
    service actors, each sending its spans to --otlp-endpoint under its own service.name."""
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    security = ClientSecurity(cluster["token"], cluster["ca"])
    await generate(cluster, security, draft_tokens=3)(metadata=(("traceparent", traceparent),))
    receiver = cluster["collector"]
    expected = {  # service.name -> span names it must have sent in this trace
        "specd-orchestrator": {"/specd.v1.SpecDecode/Generate", "specd.request", "step"},  # the actor, its worker
        "specd-draft": {"/specd.v1.DraftService/Propose"},
        "specd-target": {"/specd.v1.TargetService/Verify"},
    }

    def traced() -> dict[str, set[str]]:
        by_service = {service: set() for service in expected}
        for span in receiver.spans:
            if span.trace_id.hex() == trace_id:
                by_service.setdefault(receiver.sent_by[span.span_id], set()).add(span.name)
        return by_service

    deadline = time.monotonic() + 30  # each process sends its spans in batches, about every second

    def complete() -> bool:
        return all(names <= traced()[service] for service, names in expected.items())

    while not complete() and time.monotonic() < deadline:
        await asyncio.sleep(0.3)
    by_service = traced()
    for service, names in expected.items():
        assert names <= by_service[service], (service, by_service)


def test_a_stack_here_refuses_the_flags_it_does_not_pass_on():
    """Without --ray-address these flags would be dropped silently; they are refused before anything starts."""
    args = build_parser().parse_args(["up", "--max-prompt-tokens", "64", "--tls-cert", "c.pem", "--tls-key", "k.pem"])
    with pytest.raises(UserError, match="--tls-cert, --tls-key, --max-prompt-tokens: a stack on this machine"):
        args.run(args)
