"""Overload: Poisson arrivals at twice the measured capacity of an orchestrator with a concurrency limit.

What a user should see when more arrives than the stack can serve: the requests it admits keep the
latency they have at capacity, the rest are refused at once (RESOURCE_EXHAUSTED, with gRPC's retry
hint `grpc-retry-pushback-ms`; HTTP 429 with `Retry-After`), none waits in a queue until its
deadline, and no session is left behind on either service.

    flock /tmp/specd-heavy.lock .venv/bin/python scripts/overload.py --tiny     # the tests' tiny pair
    flock /tmp/specd-heavy.lock .venv/bin/python scripts/overload.py            # the default pair

The draft and the target run as processes of their own (`specd serve`), the orchestrator in this one
on a local Ray, with `--max-concurrent-requests LIMIT`. The scenario (`run_scenario`, which
tests/test_overload.py runs too, on in-process services):

1. capacity: a closed loop of LIMIT streams for `--capacity-seconds`: requests finished per second;
2. overload: Poisson arrivals at `--factor` x that rate for `--seconds` (each request as in 1.);
3. the figures: offered and admitted rate, latency p50/p99 of the admitted beside the closed loop's,
   refusals, their latency p99, other outcomes by status code, and the sessions left on each service.

The report goes to docs/results/overload_<cpu>.json (`--json` to change it).
"""

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from specd.bench.loadtest import Settings, arrival_offsets, build_request, cpu_tag, machine_info, percentiles
from specd.deploy.local import free_port
from specd.orchestrator.remote import wait_until_serving
from specd.v1 import common_pb2, draft_pb2_grpc, specdecode_pb2_grpc, target_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
REFUSED = "RESOURCE_EXHAUSTED"
PROMPTS = ["def quicksort(arr):", "The capital of France is", "import numpy as np\n\ndef softmax(x):"]


@dataclass
class Outcome:
    """One Generate call as the client saw it (perf_counter seconds)."""

    started: float
    ended: float = 0.0
    code: str = "OK"  # the status code's name
    tokens: int = 0
    pushback_ms: str | None = None  # the refusal's `grpc-retry-pushback-ms`, if it carried one

    @property
    def seconds(self) -> float:
        return self.ended - self.started


async def attempt(stub, settings: Settings, index: int) -> Outcome:
    """Stream request `index` to its end; an error is its code (never raised), a refusal keeps its hint."""
    outcome = Outcome(time.perf_counter())
    call = stub.Generate(build_request(settings, index), timeout=settings.timeout)
    try:
        async for reply in call:
            outcome.tokens += len(reply.delta.token_ids)
    except grpc.aio.AioRpcError as error:
        outcome.code = error.code().name
        outcome.pushback_ms = dict(error.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
    outcome.ended = time.perf_counter()
    return outcome


async def closed_loop(stub, settings: Settings, streams: int, seconds: float) -> tuple[float, list[Outcome]]:
    """`streams` clients back to back for `seconds`: (requests completed per second, the outcomes)."""
    started, outcomes, numbers = time.perf_counter(), [], iter(range(10**9))

    async def client() -> None:
        while time.perf_counter() - started < seconds:
            outcomes.append(outcome := await attempt(stub, settings, next(numbers)))
            if outcome.code == REFUSED:  # the slot of its last request was not yet free: a moment
                await asyncio.sleep(0.05)

    await asyncio.gather(*(client() for _ in range(streams)))
    completed = [outcome for outcome in outcomes if outcome.code == "OK"]
    return len(completed) / (time.perf_counter() - started), outcomes


async def poisson(stub, settings: Settings, rate: float, seconds: float, seed: int = 0) -> list[Outcome]:
    """Requests arriving as a Poisson process at `rate`/s for `seconds`, however many are in flight."""
    offsets = [at for at in arrival_offsets(rate, math.ceil(rate * seconds * 2) + 20, seed) if at < seconds]
    started, tasks = time.perf_counter(), []
    for index, offset in enumerate(offsets):
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(attempt(stub, settings, index)))
    return list(await asyncio.gather(*tasks))


def figures(capacity: float, at_capacity: list[Outcome], outcomes: list[Outcome], seconds: float) -> dict:
    """The overload's figures; latencies in seconds."""
    admitted = [outcome for outcome in outcomes if outcome.code == "OK"]
    refused = [outcome for outcome in outcomes if outcome.code == REFUSED]
    codes: dict[str, int] = {}
    for outcome in outcomes:
        codes[outcome.code] = codes.get(outcome.code, 0) + 1
    return {
        "capacity_rps": capacity,
        "capacity_latency_s": percentiles([o.seconds for o in at_capacity if o.code == "OK"]),
        "offered": len(outcomes),
        "offered_rps": len(outcomes) / seconds,
        "admitted": len(admitted),
        "admitted_rps": len(admitted) / seconds,
        "admitted_latency_s": percentiles([outcome.seconds for outcome in admitted]),
        "admitted_tokens": sorted({outcome.tokens for outcome in admitted}),
        "refused": len(refused),
        "refused_latency_s": percentiles([outcome.seconds for outcome in refused]),
        "refusal_hints_ms": sorted({str(outcome.pushback_ms) for outcome in refused}),
        "outcomes": codes,
    }


async def run_scenario(
    stub, settings: Settings, limit: int, seconds: float, capacity_seconds: float, factor: float = 2.0
) -> dict:
    """Steps 1-3 of the module's docstring against the orchestrator behind `stub` (its limit: `limit`)."""
    await closed_loop(stub, settings, limit, min(2.0, capacity_seconds))  # warm-up: first passes, K's estimates
    capacity, at_capacity = await closed_loop(stub, settings, limit, capacity_seconds)
    outcomes = await poisson(stub, settings, factor * capacity, seconds, settings.seed)
    return {"limit": limit, "factor": factor, "seconds": seconds, **figures(capacity, at_capacity, outcomes, seconds)}


async def live_sessions(draft: str, target: str) -> tuple[int, int]:
    """What each service holds now (ModelInfo.live_sessions), asked over gRPC."""
    answers = []
    for address, stub_class in ((draft, draft_pb2_grpc.DraftServiceStub), (target, target_pb2_grpc.TargetServiceStub)):
        async with grpc.aio.insecure_channel(address) as channel:
            answers.append((await stub_class(channel).Info(common_pb2.InfoRequest(), timeout=10)).live_sessions)
    return answers[0], answers[1]


async def drained(draft: str, target: str, timeout_s: float = 20.0) -> tuple[int, int]:
    """The sessions left on (draft, target) once they reach (0, 0), or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (live := await live_sessions(draft, target)) != (0, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return live


def summary(report: dict) -> str:
    latency, capacity, refusals = (
        report["admitted_latency_s"],
        report["capacity_latency_s"],
        report["refused_latency_s"],
    )
    refused_p99 = "-" if refusals["p99"] is None else f"{refusals['p99'] * 1000:.0f} ms"
    return (
        f"capacity {report['capacity_rps']:.2f} req/s at {report['limit']} streams "
        f"(latency p50 {capacity['p50']:.2f} s, p99 {capacity['p99']:.2f} s); "
        f"offered {report['offered_rps']:.2f} req/s ({report['offered']} in {report['seconds']:.0f} s): "
        f"admitted {report['admitted_rps']:.2f} req/s ({report['admitted']}), latency p50 {latency['p50']:.2f} s, "
        f"p99 {latency['p99']:.2f} s; refused {report['refused']}, refusal p99 {refused_p99}; "
        f"outcomes {report['outcomes']}"
    )


# ---------------------------------------------------------------- the stack


def serve(role: str, model: str, port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "specd.cli", "serve", role, "--model", model, "--port", str(port), "--no-metrics"]
    return subprocess.Popen(
        command + extra,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def tiny_pair(folder: Path) -> dict[str, str]:
    """The tests' tiny pair (tests/conftest.py make_tiny_model): random 2-layer Qwen2s, the real tokenizer."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tiny_model

    return {
        "draft": str(make_tiny_model(folder / "draft", 2, noise=0.007)),
        "target": str(make_tiny_model(folder / "target", 2)),
    }


async def main_async(args: argparse.Namespace) -> dict:
    import ray

    from specd.orchestrator.server import OrchestratorServer

    folder = Path(tempfile.mkdtemp(prefix="specd-overload-"))
    models = tiny_pair(folder) if args.tiny else {"draft": args.draft_model, "target": args.target_model}
    extra = ["--dtype", "float32", "--threads", "1"] if args.tiny else []
    addresses, processes = {}, []
    for role in ("draft", "target"):
        port = free_port()
        processes.append(serve(role, models[role], port, folder / f"{role}.log", extra + ["--max-sessions", "64"]))
        addresses[role] = f"127.0.0.1:{port}"
    ray.init(include_dashboard=False, logging_level="WARNING", configure_logging=False)
    orchestrator = None
    try:
        await asyncio.gather(*(wait_until_serving(address, 900) for address in addresses.values()))
        orchestrator = OrchestratorServer(
            addresses["draft"], addresses["target"], workers=args.workers, max_concurrent_requests=args.limit
        )
        await orchestrator.start("127.0.0.1:0")
        settings = Settings("", PROMPTS, max_new_tokens=args.max_new_tokens, timeout=args.timeout)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            report = await run_scenario(
                specdecode_pb2_grpc.SpecDecodeStub(channel),
                settings,
                args.limit,
                args.seconds,
                args.capacity_seconds,
                args.factor,
            )
        report["sessions_left"] = dict(zip(("draft", "target"), await drained(addresses["draft"], addresses["target"])))
        report["settings"] = {
            "models": "tiny (tests/conftest.py)" if args.tiny else models,
            "max_new_tokens": args.max_new_tokens,
            "workers": args.workers,
            "timeout_s": args.timeout,
            "machine": machine_info(),
            "load_average_1m_after": os.getloadavg()[0],  # other work on the machine skews every figure
        }
        return report
    finally:
        if orchestrator:
            await orchestrator.stop(0)
        ray.shutdown()
        for process in processes:
            process.terminate()
            process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random pair instead of the default one")
    parser.add_argument("--draft-model", default="draft")
    parser.add_argument("--target-model", default="target")
    parser.add_argument("--limit", type=int, default=4, help="the orchestrator's --max-concurrent-requests")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--factor", type=float, default=2.0, help="offered load / measured capacity")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the overload lasts")
    parser.add_argument("--capacity-seconds", type=float, default=10.0)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0, help="each request's deadline")
    parser.add_argument("--json", type=Path, default=None, help="default: docs/results/overload_<cpu>.json")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    print(summary(report))
    print(f"sessions left (draft, target): {report['sessions_left']}")
    path = args.json or ROOT / "docs" / "results" / f"overload_{cpu_tag()}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report written to {path}")


if __name__ == "__main__":
    main()
