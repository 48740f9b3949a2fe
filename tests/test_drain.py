"""Graceful drain (SIGTERM, a rolling update): the requests in flight finish, new ones are refused at
once (UNAVAILABLE, health NOT_SERVING, HTTP 503 with Retry-After), and what cannot finish within
--drain-seconds ends UNAVAILABLE with a message that says so. Real servers on tiny models; the last
test sends SIGTERM to real `specd serve target` and `specd serve orchestrator` processes.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from conftest import Services
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.deploy.local import free_port
from specd.draft_service.drafter import Drafter
from specd.draft_service.server import create_draft_server
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.remote import wait_until_serving
from specd.orchestrator.server import SERVICE_NAME, OrchestratorServer
from specd.proto.auth import ServerSecurity
from specd.proto.contract import fingerprint
from specd.proto.limits import Limits
from specd.target_service.server import SERVICE_NAME as TARGET_SERVICE
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier
from specd.v1 import common_pb2, specdecode_pb2, specdecode_pb2_grpc, target_pb2

PROMPT = "def quicksort(arr):"
PROMPT_IDS = [785, 8251, 7640, 389, 279, 5837, 13, 576]
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def cursor(session: str, committed: list[int], start: int) -> common_pb2.SessionCursor:
    """Keep the first `start` committed tokens, send the rest (docs/architecture.md §3)."""
    return common_pb2.SessionCursor(
        session_id=session, start=start, fingerprint=fingerprint(committed[:start]), tokens=committed[start:]
    )


def request(max_new_tokens: int, k: int = 4) -> specdecode_pb2.GenerateRequest:
    return specdecode_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=max_new_tokens, draft_tokens=k, ignore_eos=True, drafter="model"
    )


class SlowSteps(grpc.aio.ServerInterceptor):
    """Delays each Verify and Decode by `delay` seconds: the tiny target is fast, and a request must
    still be running when the drain begins."""

    def __init__(self, delay: float):
        self.delay = delay

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.endswith(("/Verify", "/Decode")):
            return handler
        behavior = handler.unary_unary

        async def slowed(message, context):
            await asyncio.sleep(self.delay)
            return await behavior(message, context)

        return grpc.unary_unary_rpc_method_handler(slowed, handler.request_deserializer, handler.response_serializer)


class Slowed(ServerSecurity):
    """No auth, plus SlowSteps."""

    def __init__(self, interceptor: SlowSteps):
        super().__init__()
        object.__setattr__(self, "slow", interceptor)

    def interceptors(self):
        return [self.slow, *super().interceptors()]


class DrainStack:
    """Tiny services in this process (the target's steps slowed) and an orchestrator on Ray with its HTTP API."""

    async def start(self, tiny_loaded, delay: float) -> "DrainStack":
        self.slow = SlowSteps(delay)
        draft = create_draft_server(lambda: Drafter(TransformersEngine(tiny_loaded["draft"]), Limits()))
        target = create_target_server(lambda: Verifier(TransformersEngine(tiny_loaded["target"]), Limits()))
        await draft.start("127.0.0.1:0")
        await target.start("127.0.0.1:0", Slowed(self.slow))
        await asyncio.gather(draft.load(), target.load())
        self.services = Services(draft, target)
        self.orchestrator = OrchestratorServer(f"127.0.0.1:{draft.port}", f"127.0.0.1:{target.port}", workers=1)
        await self.orchestrator.start("127.0.0.1:0")
        self.http = f"http://127.0.0.1:{await self.orchestrator.start_http('127.0.0.1', 0)}"
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.orchestrator.port}")
        self.client = specdecode_pb2_grpc.SpecDecodeStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        return self

    async def close(self) -> None:
        await self.channel.close()
        await self.orchestrator.stop(0)
        await self.services.close()

    async def sessions(self) -> tuple[int, int]:
        draft = await self.services.draft.Info(common_pb2.InfoRequest())
        target = await self.services.target.Info(common_pb2.InfoRequest())
        return draft.live_sessions, target.live_sessions

    async def sessions_end(self, timeout_s: float = 10.0) -> tuple[int, int]:
        deadline = time.monotonic() + timeout_s
        while (live := await self.sessions()) != (0, 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return live


@pytest.fixture
async def stack(tiny_loaded, ray_local):
    stack = await DrainStack().start(tiny_loaded, delay=0.05)
    yield stack
    await stack.close()


async def collect(call) -> tuple[list[int], specdecode_pb2.Final | None]:
    tokens, final = [], None
    async for reply in call:
        if reply.HasField("delta"):
            tokens += reply.delta.token_ids
        else:
            final = reply.final
    return tokens, final


async def first_delta(call) -> list[int]:
    async for reply in call:
        return list(reply.delta.token_ids)


def http_stream(url: str, max_tokens: int, started: threading.Event) -> list[dict]:
    """A streamed completion's events (JSON payloads), read in a thread; `started` is set at its first."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    with urllib.request.urlopen(post(f"{url}/v1/completions", body), timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
                started.set()
    return events


def post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def http_call(request: urllib.request.Request | str):
    """(status, headers, body text) of one plain HTTP call."""
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


def http_text(events: list[dict]) -> str:
    return "".join(choice["text"] for event in events for choice in event.get("choices", []))


async def test_requests_in_flight_finish_exactly_while_new_ones_are_refused_at_once(stack):
    expected, _ = await collect(stack.client.Generate(request(60)))
    http_started = threading.Event()
    http_before = asyncio.create_task(asyncio.to_thread(http_stream, stack.http, 40, http_started))
    call = stack.client.Generate(request(60))
    tokens = await first_delta(call)
    assert await asyncio.to_thread(http_started.wait, 30)
    # Both streams are running: drain (long enough for both), and meanwhile ask for more.
    stopping = asyncio.create_task(stack.orchestrator.stop(60))
    started = time.monotonic()
    await asyncio.sleep(0.05)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(stack.client.Generate(request(8)))
    assert time.monotonic() - started < 2, "refused at once, not after the drain"
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in refused.value.details() and "another replica" in refused.value.details()
    for name in ("", SERVICE_NAME):
        reply = await stack.health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == NOT_SERVING, name
    late = post(f"{stack.http}/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    status, headers, text = await asyncio.to_thread(http_call, late)
    assert status == 503 and headers["Retry-After"] == "1", (status, text)
    assert "draining" in json.loads(text)["error"]["message"]
    assert (await asyncio.to_thread(http_call, f"{stack.http}/health"))[0] == 503
    assert not stopping.done(), "the drain waits for the requests in flight"
    rest, final = await collect(call)
    http_events = await http_before
    await stopping
    drained = time.monotonic() - started
    assert tokens + rest == expected and final.finish_reason == "length"  # the whole output, exact
    assert http_events[-1]["choices"][0]["finish_reason"] == "length"
    expected_text = stack.orchestrator.core.tokenizer.decode(expected[:40])
    assert http_text(http_events) == expected_text
    assert drained < 30, f"the drain ended when its requests did, not at --drain-seconds ({drained:.1f} s)"
    assert await stack.sessions_end() == (0, 0)


async def test_what_outlasts_the_drain_ends_unavailable_with_a_clear_message(stack, caplog):
    drain_seconds = 1.5
    caplog.set_level("INFO", logger="specd.orchestrator")
    http_started = threading.Event()
    http_before = asyncio.create_task(asyncio.to_thread(http_stream, stack.http, 2000, http_started))
    call = stack.client.Generate(request(2000))  # 2000 tokens, steps of >= 50 ms: far longer than the drain
    await first_delta(call)
    assert await asyncio.to_thread(http_started.wait, 30)
    started = time.monotonic()
    stopping = asyncio.create_task(stack.orchestrator.stop(drain_seconds))
    with pytest.raises(grpc.aio.AioRpcError) as cut:
        await collect(call)
    ended = time.monotonic() - started
    http_events = await http_before
    await stopping
    stopped = time.monotonic() - started
    print(f"cut after {ended:.2f} s, stopped after {stopped:.2f} s (--drain-seconds {drain_seconds})")
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down before the request finished" in cut.value.details()
    assert drain_seconds - 0.2 < ended < drain_seconds + 5
    assert stopped < drain_seconds + 8, "the server stopped soon after the drain"
    error = http_events[-1]["error"]  # the SSE stream's last event says why it ended
    assert error["code"] == "UNAVAILABLE" and "shut down before the request finished" in error["message"]
    assert "finish_reason" not in json.dumps(http_events[-1])
    lines = [record.getMessage() for record in caplog.records if record.name == "specd.orchestrator"]
    assert any(line.startswith("draining: refusing new requests, 2 in flight") for line in lines), lines
    assert any("requests: 0 finished, 2 cut" in line for line in lines), lines
    assert await stack.sessions_end() == (0, 0)  # the cut requests released their sessions


async def test_specd_generate_against_a_draining_server_prints_the_completion_and_exits_0(stack):
    """The drain begins while `specd generate --server` runs its request: that request finishes, and
    the target-only run the command then starts to measure the speed-up is refused (UNAVAILABLE).
    The completion and its stats still print, the refusal is one warning line, and the exit is 0."""
    stack.slow.delay = 0.2  # each target call: the request is still running when the drain begins
    greedy = specdecode_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=8, draft_tokens=0)
    expected = "".join([reply.delta.text async for reply in stack.client.Generate(greedy)])
    drain = stack.orchestrator.core.drain
    command = ["generate", PROMPT, "--server", f"127.0.0.1:{stack.orchestrator.port}", "--max-new-tokens", "8"]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "specd.cli", *command, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    output = asyncio.create_task(process.communicate())
    async with asyncio.timeout(60):
        while not drain.in_flight:  # the command's request has started
            assert not output.done(), (await output)[1].decode()[-3000:]
            await asyncio.sleep(0.01)
    draining = asyncio.create_task(drain.drain(60))  # as SIGTERM starts it; the server stays up, refusing
    stdout, stderr = (part.decode() for part in await asyncio.wait_for(output, 120))
    assert (await draining) == (1, 0)  # the request in flight finished, none was cut
    assert process.returncode == 0, stderr[-3000:]
    assert stdout == expected + "\n"  # the whole completion (greedy: the target's own text)
    warnings = [line for line in stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "UNAVAILABLE" in warnings[0] and "draining" in warnings[0], stderr
    assert "acceptance rate" in stderr and "tokens/s" in stderr  # the stats table
    assert "speed-up over target-only" not in stderr and "Traceback" not in stderr


async def test_a_draining_service_serves_the_sessions_it_holds_and_opens_no_new_ones(tiny_services):
    """The model service's side: the orchestrator's requests in flight keep their sessions served
    (Decode, Verify, Propose, Release), so they can finish; a new session is refused at once."""
    target, stub = tiny_services.target_server, tiny_services.target
    committed = list(PROMPT_IDS)
    reply = await stub.Decode(target_pb2.DecodeRequest(cursor=cursor("held", committed, 0)))  # opens "held"
    committed += reply.emitted_tokens
    started = time.monotonic()
    stopping = asyncio.create_task(target.stop(60))
    await asyncio.sleep(0.05)
    health = health_pb2_grpc.HealthStub(tiny_services.target_channel)
    for name in ("", TARGET_SERVICE):
        assert (await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status == NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Decode(target_pb2.DecodeRequest(cursor=cursor("new", PROMPT_IDS, 0)), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "opens no new ones" in refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Prefill(common_pb2.PrefillRequest(cursor=cursor("new", PROMPT_IDS, 0)), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    for _ in range(3):  # the held session goes on as before
        start = len(committed) - 1
        reply = await stub.Decode(target_pb2.DecodeRequest(cursor=cursor("held", committed, start)), timeout=5)
        assert reply.cached_tokens == start + 1 and len(reply.emitted_tokens) == 1
        committed += reply.emitted_tokens
    verified = await stub.Verify(
        target_pb2.VerifyRequest(cursor=cursor("held", committed, len(committed) - 1), draft_tokens=[11, 12]),
        timeout=5,
    )
    assert verified.cached_tokens >= len(committed)
    assert not stopping.done(), "the drain waits for the session held"
    assert (await stub.Release(common_pb2.ReleaseRequest(session_id="held"), timeout=5)).released
    await asyncio.wait_for(stopping, 10)  # it stops once the last session is released, not at 60 s
    assert time.monotonic() - started < 30


def serve(tmp_path, name: str, *args: str) -> tuple[subprocess.Popen, int, object]:
    port = free_port()
    log = (tmp_path / f"{name}.log").open("w")
    command = [sys.executable, "-m", "specd.cli", "serve", *args, "--port", str(port), "--no-metrics"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return process, port, tmp_path / f"{name}.log"


async def test_sigterm_to_real_target_and_orchestrator_processes_lets_the_request_finish(
    tiny_dirs, tiny_loaded, tmp_path
):
    """As a pod's processes stop in a rolling update: both get SIGTERM while a request runs."""
    draft = create_draft_server(lambda: Drafter(TransformersEngine(tiny_loaded["draft"]), Limits()))
    await draft.start("127.0.0.1:0")
    await draft.load()
    model = ["--model", str(tiny_dirs["target"]), "--dtype", "float32", "--threads", "1"]
    target, target_port, target_log = serve(tmp_path, "target", "target", *model, "--drain-seconds", "60")
    orchestrator, port, orchestrator_log = serve(  # it waits for the target to serve
        tmp_path,
        "orchestrator",
        "orchestrator",
        *("--draft", f"127.0.0.1:{draft.port}", "--target", f"127.0.0.1:{target_port}"),
        *("--workers", "1", "--no-http", "--drain-seconds", "60"),
    )
    try:
        await wait_until_serving(f"127.0.0.1:{port}", timeout_s=180)
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{target_port}") as target_channel,
        ):
            client = specdecode_pb2_grpc.SpecDecodeStub(channel)
            expected, _ = await collect(client.Generate(request(150, k=0)))
            call = client.Generate(request(150, k=0))
            tokens = await first_delta(call)
            for process in (orchestrator, target):
                process.send_signal(signal.SIGTERM)
            for serving in (channel, target_channel):  # both drain: the request keeps its target session
                health = health_pb2_grpc.HealthStub(serving)
                while (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != NOT_SERVING:
                    await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(client.Generate(request(4)))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
            rest, final = await collect(call)
        assert tokens + rest == expected and final.finish_reason == "length"
        assert orchestrator.wait(60) == 0
        assert target.wait(60) == 0
        orchestrator_lines, target_lines = orchestrator_log.read_text(), target_log.read_text()
        assert "requests: 1 finished, 0 cut" in orchestrator_lines, orchestrator_lines[-2000:]
        assert "sessions: 1 ended, 0 cut" in target_lines, target_lines[-2000:]
    finally:
        for process in (orchestrator, target):
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
        await draft.stop(0)


def test_drain_seconds_reaches_every_process_specd_up_starts_and_bad_values_are_refused(monkeypatch, capsys):
    """`specd up --drain-seconds S` passes S to all three `specd serve` command lines (nothing started)."""
    from specd.cli import build_parser
    from specd.cli.common import check_stack_devices
    from specd.cli.up import run_here
    from specd.deploy.local import Child, LocalStack

    spawned: dict[str, list[str]] = {}

    def spawn(self, name, port, metrics_port, serve_args, env=None):
        spawned[name] = serve_args
        return Child(name, "127.0.0.1:1", process=None, log=None)

    async def wait(self, child):
        if child.name == "orchestrator":
            raise KeyboardInterrupt  # as Ctrl-C would; the stack then stops (nothing to stop here)

    monkeypatch.setattr(LocalStack, "_spawn", spawn)
    monkeypatch.setattr(LocalStack, "_wait", wait)
    monkeypatch.setattr(LocalStack, "stop", lambda self: spawned.setdefault("stopped", []))
    args = build_parser().parse_args(["up", "--drain-seconds", "7.5", "--device", "cpu", "--draft-device", "cpu"])
    assert run_here(args, check_stack_devices(args)) == 0
    for name in ("draft", "target", "orchestrator"):
        assert spawned[name][spawned[name].index("--drain-seconds") + 1] == "7.5", name
    assert "stopped" in spawned
    orchestrator = ["serve", "orchestrator", "--draft", "a:1", "--target", "b:2"]
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*orchestrator, "--drain-seconds", bad])
        assert "--drain-seconds" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "target"]).drain_seconds == 30
