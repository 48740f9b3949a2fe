"""Soak: 200 requests at concurrency 8 with random client cancels, on tiny models.

The draft and the target run as their own processes (`specd serve`), so each one's RSS is its
own; the orchestrator runs here on Ray. Expected: no error but the cancels, both services back
to zero sessions, and each service's RSS within 10 % of its value after a warm-up.
"""

import asyncio
import random
import subprocess
import sys
import time

import grpc
import psutil
import pytest

from specd.deploy.local import free_port
from specd.orchestrator.remote import wait_until_serving
from specd.orchestrator.server import OrchestratorServer
from specd.v1 import common_pb2, draft_pb2_grpc, specdecode_pb2, specdecode_pb2_grpc, target_pb2_grpc

PROMPTS = [
    "def quicksort(arr):",
    "The capital of France is",
    "import numpy as np\n\ndef softmax(x):",
    "# Parse an ISO 8601 date\n",
    "SELECT name FROM users WHERE",
]
REQUESTS, CONCURRENCY, WARM_UP = 200, 8, 60


@pytest.fixture(scope="module")
async def process_stack(tiny_dirs, ray_local, tmp_path_factory):
    logs = tmp_path_factory.mktemp("soak")
    processes, addresses = {}, {}
    for role in ("draft", "target"):
        port = free_port()
        processes[role] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "specd.cli",
                "serve",
                role,
                "--model",
                str(tiny_dirs[role]),
                "--dtype",
                "float32",
                "--threads",
                "1",
                "--port",
                str(port),
                "--no-metrics",
                "--max-sessions",
                "32",
            ],
            stdout=open(logs / f"{role}.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        addresses[role] = f"127.0.0.1:{port}"
    orchestrator = None
    try:
        await asyncio.gather(*(wait_until_serving(address, 180) for address in addresses.values()))
        orchestrator = OrchestratorServer(addresses["draft"], addresses["target"], workers=2)
        await orchestrator.start("127.0.0.1:0")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}")
        yield specdecode_pb2_grpc.SpecDecodeStub(channel), processes, addresses
        await channel.close()
    finally:
        if orchestrator:
            await orchestrator.stop(0)
        for process in processes.values():
            process.terminate()
            process.wait(30)


async def one_request(client, rng: random.Random) -> str:
    """'done', 'cancelled', or the status code name of an error."""
    message = specdecode_pb2.GenerateRequest(
        prompt=rng.choice(PROMPTS),
        max_new_tokens=rng.randint(8, 24),
        draft_tokens=rng.choice([0, 2, 4, 6]),
        sampling=common_pb2.SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 1000)),
    )
    cancel_after = rng.randint(1, 3) if rng.random() < 0.25 else None
    call = client.Generate(message, timeout=120)
    deltas = 0
    try:
        async for reply in call:
            if reply.HasField("final"):
                return "done"
            deltas += 1
            if deltas == cancel_after:
                call.cancel()
                return "cancelled"
    except grpc.aio.AioRpcError as error:
        return error.code().name
    return "no final message"


async def run_load(client, count: int, seed: int) -> dict[str, int]:
    rng, gate, outcomes = random.Random(seed), asyncio.Semaphore(CONCURRENCY), {}

    async def limited():
        async with gate:
            outcome = await one_request(client, rng)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    await asyncio.gather(*(limited() for _ in range(count)))
    return outcomes


async def live_sessions(addresses) -> tuple[int, int]:
    answers = []
    for role, stub_class in (("draft", draft_pb2_grpc.DraftServiceStub), ("target", target_pb2_grpc.TargetServiceStub)):
        async with grpc.aio.insecure_channel(addresses[role]) as channel:
            answers.append((await stub_class(channel).Info(common_pb2.InfoRequest(), timeout=10)).live_sessions)
    return tuple(answers)


async def drained(addresses, timeout_s: float = 20.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while (live := await live_sessions(addresses)) != (0, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return live


def rss_mib(processes) -> dict[str, float]:
    return {role: psutil.Process(process.pid).memory_info().rss / 2**20 for role, process in processes.items()}


# Serial: its RSS is only flat with the machine to itself. Beside another test's load the kernel
# reclaimed a tenth of the target's pages mid-soak (778.8 -> 699.6 MiB): a change the test would read as
# much as a leak.
@pytest.mark.serial
async def test_soak_200_requests_with_cancels_no_errors_no_leaks_flat_memory(process_stack):
    client, processes, addresses = process_stack
    warm = await run_load(client, WARM_UP, seed=1)
    assert set(warm) <= {"done", "cancelled"}, warm
    assert await drained(addresses) == (0, 0)
    before = rss_mib(processes)
    started = time.monotonic()
    outcomes = await run_load(client, REQUESTS, seed=2)
    seconds = time.monotonic() - started
    live = await drained(addresses)
    after = rss_mib(processes)
    print(
        f"\nsoak: {REQUESTS} requests at concurrency {CONCURRENCY} in {seconds:.1f} s: {outcomes}; "
        f"live sessions after (draft, target) = {live}"
    )
    for role in before:
        print(
            f"soak: {role} RSS {before[role]:.1f} MiB after warm-up -> {after[role]:.1f} MiB after the soak "
            f"({(after[role] / before[role] - 1) * 100:+.1f} %)"
        )
    assert set(outcomes) <= {"done", "cancelled"}, outcomes
    assert sum(outcomes.values()) == REQUESTS and outcomes.get("cancelled", 0) > 0
    assert live == (0, 0)
    for role in before:
        assert abs(after[role] / before[role] - 1) <= 0.10, (role, before[role], after[role])
