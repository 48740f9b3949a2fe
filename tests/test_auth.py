"""Bearer token and TLS on every server: missing or wrong token -> UNAUTHENTICATED (health stays
open), TLS with a self-signed certificate made here with the openssl CLI, the orchestrator
passing its own credentials to the services, and the command line (`specd serve --token
--tls-cert --tls-key`, `specd generate --server --token --tls-ca`, SPECD_TOKEN)."""

import asyncio
import json
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.deploy.local import free_port
from specd.draft_service.drafter import Drafter
from specd.draft_service.server import create_draft_server
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.remote import wait_until_serving
from specd.orchestrator.server import OrchestratorServer
from specd.proto.auth import ClientSecurity, ServerSecurity
from specd.proto.limits import Limits
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier
from specd.v1 import common_pb2, draft_pb2_grpc, specdecode_pb2, specdecode_pb2_grpc

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> dict:
    """A self-signed certificate for localhost and 127.0.0.1 (it is its own CA)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return {
        "cert": cert,
        "key": key,
        "server": ServerSecurity(TOKEN, cert.read_bytes(), key.read_bytes()),
        "client": ClientSecurity(TOKEN, cert.read_bytes()),
    }


@pytest.fixture(scope="module")
async def secured(tiny_loaded, ray_local, certificate):
    """Draft, target and orchestrator, all with the token and TLS; the orchestrator uses the same to the services."""
    draft = create_draft_server(lambda: Drafter(TransformersEngine(tiny_loaded["draft"]), Limits()))
    target = create_target_server(lambda: Verifier(TransformersEngine(tiny_loaded["target"]), Limits()))
    for server in (draft, target):
        await server.start("127.0.0.1:0", certificate["server"])
        await server.load()
    orchestrator = OrchestratorServer(
        f"127.0.0.1:{draft.port}",
        f"127.0.0.1:{target.port}",
        workers=1,
        security=certificate["server"],
        service_security=certificate["client"],
    )
    await orchestrator.start("127.0.0.1:0")
    yield {
        "draft": f"127.0.0.1:{draft.port}",
        "target": f"127.0.0.1:{target.port}",
        "orchestrator": f"127.0.0.1:{orchestrator.port}",
    }
    await orchestrator.stop(0)
    await draft.stop(0)
    await target.stop(0)


GENERATE = specdecode_pb2.GenerateRequest(prompt="def f(x):", max_new_tokens=5, ignore_eos=True)


async def generate(address: str, security: ClientSecurity) -> list[int]:
    async with security.channel(address) as channel:
        stub = specdecode_pb2_grpc.SpecDecodeStub(channel)
        return [token async for reply in stub.Generate(GENERATE, timeout=60) for token in reply.delta.token_ids]


async def draft_info(address: str, security: ClientSecurity):
    async with security.channel(address) as channel:
        return await draft_pb2_grpc.DraftServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=10)


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details()


async def test_the_right_token_over_tls_is_served_end_to_end(secured, certificate):
    # The orchestrator reached both services with its own token and CA, or it would not have started.
    assert len(await generate(secured["orchestrator"], certificate["client"])) == 5
    assert (await draft_info(secured["draft"], certificate["client"])).role == "draft"


@pytest.mark.parametrize("server", ["orchestrator", "draft", "target"])
async def test_missing_or_wrong_token_is_unauthenticated(secured, certificate, server):
    ca = certificate["cert"].read_bytes()
    for security, says in [
        (ClientSecurity(None, ca), "no `authorization: Bearer <token>` metadata"),
        (ClientSecurity("wrong", ca), "the bearer token is wrong"),
    ]:
        async with security.channel(secured[server]) as channel:
            method = {
                "orchestrator": "/specd.v1.SpecDecode/Info",
                "draft": "/specd.v1.DraftService/Info",
                "target": "/specd.v1.TargetService/Info",
            }[server]
            code, details = await status_of(channel.unary_unary(method)(b"", timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert says in details and "--token" in details
    code, _ = await status_of(generate(secured["orchestrator"], ClientSecurity("wrong", ca)))
    assert code == grpc.StatusCode.UNAUTHENTICATED


async def test_health_stays_open_without_a_token_but_not_without_tls(secured, certificate):
    open_to_all = ClientSecurity(None, certificate["cert"].read_bytes())
    for address in secured.values():
        async with open_to_all.channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    code, _ = await status_of(draft_info(secured["draft"], ClientSecurity(TOKEN)))  # plaintext to a TLS port
    assert code == grpc.StatusCode.UNAVAILABLE


async def test_specd_generate_sends_the_token_and_trusts_the_ca(secured, certificate):
    """The CLI client with SPECD_TOKEN, and --token over it; a wrong token is a clear error."""
    base = [
        sys.executable,
        "-m",
        "specd.cli",
        "generate",
        "def f(x):",
        "--server",
        secured["orchestrator"],
        "--json",
        "--no-baseline",
        "--max-new-tokens",
        "4",
        "--tls-ca",
        str(certificate["cert"]),
    ]

    async def run(*extra, env_token=None):
        env = (
            {**os.environ, "SPECD_TOKEN": env_token}
            if env_token
            else {k: v for k, v in os.environ.items() if k != "SPECD_TOKEN"}
        )
        process = await asyncio.create_subprocess_exec(
            *base, *extra, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(process.communicate(), 300)
        return process.returncode, out.decode(), err.decode()

    code, out, err = await run(env_token=TOKEN)
    assert code == 0, err[-2000:]
    assert json.loads(out)["usage"]["completion_tokens"] == 4
    code, out, err = await run("--token", "wrong", env_token=TOKEN)  # the flag wins over SPECD_TOKEN
    assert code == 2 and "UNAUTHENTICATED" in err and "Traceback" not in err


async def test_specd_serve_takes_token_and_tls_flags(tiny_dirs, certificate, tmp_path):
    """`specd serve draft --tls-cert --tls-key` with the token from SPECD_TOKEN, as a process."""
    port = free_port()
    log = open(tmp_path / "draft.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specd.cli",
            "serve",
            "draft",
            "--model",
            str(tiny_dirs["draft"]),
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--port",
            str(port),
            "--no-metrics",
            "--tls-cert",
            str(certificate["cert"]),
            "--tls-key",
            str(certificate["key"]),
        ],
        env={**os.environ, "SPECD_TOKEN": TOKEN},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        address = f"127.0.0.1:{port}"
        await wait_until_serving(address, 120, ClientSecurity(None, certificate["cert"].read_bytes()))
        assert (await draft_info(address, certificate["client"])).role == "draft"
        code, _ = await status_of(draft_info(address, ClientSecurity(None, certificate["cert"].read_bytes())))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        process.terminate()
        process.wait(30)
