"""Overload on tiny models: Poisson arrivals at twice the measured capacity of an orchestrator with
`--max-concurrent-requests`. The admitted requests keep a bounded latency, the rest are refused at
once with a retry hint (gRPC RESOURCE_EXHAUSTED + `grpc-retry-pushback-ms`, HTTP 429 + `Retry-After`),
none runs into its deadline in a queue, and no session is left behind.

The scenario is scripts/overload.py's (`run_scenario`), here over in-process services (they start
in a moment); the script runs it over `specd serve` processes and writes the figures to
docs/results/overload_<cpu>.json.
"""

import asyncio
import importlib.util
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import start_services

from specd.bench.loadtest import Settings
from specd.orchestrator.request import RETRY_AFTER_S
from specd.orchestrator.server import OrchestratorServer
from specd.proto.limits import Limits
from specd.v1 import specdecode_pb2, specdecode_pb2_grpc

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "overload.py"
spec = importlib.util.spec_from_file_location("overload", SCRIPT)
overload = importlib.util.module_from_spec(spec)
spec.loader.exec_module(overload)

LIMIT = 4  # the orchestrator's --max-concurrent-requests
SETTINGS = Settings("", overload.PROMPTS, max_new_tokens=32, timeout=60.0)


@pytest.fixture(scope="module")
async def limited(tiny_loaded, ray_local):
    """Tiny in-process services and an orchestrator that admits LIMIT requests at once, gRPC and HTTP."""
    services = await start_services(tiny_loaded["draft"], tiny_loaded["target"], Limits(max_sessions=32))
    orchestrator = OrchestratorServer(
        f"127.0.0.1:{services.draft_server.port}",
        f"127.0.0.1:{services.target_server.port}",
        workers=2,
        max_concurrent_requests=LIMIT,
    )
    await orchestrator.start("127.0.0.1:0")
    http_port = await orchestrator.start_http("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}")
    addresses = (f"127.0.0.1:{services.draft_server.port}", f"127.0.0.1:{services.target_server.port}")
    try:
        yield specdecode_pb2_grpc.SpecDecodeStub(channel), f"http://127.0.0.1:{http_port}", orchestrator, addresses
    finally:
        await channel.close()
        await orchestrator.stop(0)
        await services.close()


def post(url: str, body: dict) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one POST, errors included."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read() or b"{}")


async def test_a_refusal_for_load_says_when_to_retry_over_grpc_and_http(limited):
    client, base, orchestrator, addresses = limited
    long = specdecode_pb2.GenerateRequest(prompt="def quicksort(arr):", max_new_tokens=2000, ignore_eos=True)
    holding = [client.Generate(long, timeout=60) for _ in range(LIMIT)]
    for call in holding:
        async for _ in call:  # each holds its place once its first delta came
            break
    assert sum(orchestrator.pool.in_flight) == LIMIT
    started = time.perf_counter()
    refusal = await overload.attempt(client, SETTINGS, 0)
    assert refusal.code == "RESOURCE_EXHAUSTED" and refusal.seconds < 2.0, refusal
    assert refusal.pushback_ms == str(round(RETRY_AFTER_S * 1000))
    for stream in (False, True):
        body = {"prompt": "def quicksort(arr):", "max_tokens": 4, "stream": stream}
        status, headers, answer = await asyncio.to_thread(post, f"{base}/v1/completions", body)
        assert status == 429 and answer["error"]["code"] == "RESOURCE_EXHAUSTED", (status, answer)
        assert headers.get("retry-after", headers.get("Retry-After")) == "1", headers
    print(f"\nrefused over gRPC and HTTP (twice) in {time.perf_counter() - started:.2f} s")
    for call in holding:
        call.cancel()
    assert await overload.drained(*addresses) == (0, 0)


@pytest.mark.serial  # it measures the capacity, then latencies against it: nothing else may change the machine
async def test_twice_the_capacity_admits_about_capacity_and_refuses_the_rest_at_once(limited):
    client, _, orchestrator, addresses = limited
    report = await overload.run_scenario(client, SETTINGS, LIMIT, seconds=12.0, capacity_seconds=5.0)
    live = await overload.drained(*addresses)
    print(f"\noverload: {overload.summary(report)}; sessions left (draft, target) {live}")
    capacity, admitted, refused = (
        report["capacity_latency_s"],
        report["admitted_latency_s"],
        report["refused_latency_s"],
    )
    # Only two outcomes: served whole, or refused at once. Nothing ran into its 60 s deadline in a queue.
    assert set(report["outcomes"]) <= {"OK", "RESOURCE_EXHAUSTED"}, report["outcomes"]
    assert report["admitted_tokens"] == [SETTINGS.max_new_tokens]
    assert report["refused"] >= 0.15 * report["offered"], "twice the capacity: a good part is refused"
    assert report["admitted"] >= 0.3 * report["capacity_rps"] * report["seconds"], "the stack kept serving"
    # The admitted wait for no one: their latency stays near what it is at capacity (generous: shared cores).
    # (A queue instead would add seconds for every second of the overload: 2x capacity for 12 s.)
    assert admitted["p99"] <= 3 * capacity["p99"] + 2.0, (admitted, capacity)
    # A refusal is answered at once: well under an admitted request's time, and under a second.
    assert refused["p99"] <= min(1.0, admitted["p50"]), (refused, admitted)
    assert report["refusal_hints_ms"] == [str(round(RETRY_AFTER_S * 1000))]
    assert live == (0, 0) and sum(orchestrator.pool.in_flight) == 0
