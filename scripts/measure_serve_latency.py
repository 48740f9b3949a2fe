"""Issue 39's data-path question: should Ray Serve carry the replica pools? A speculative step makes
one or two calls to the model services, so the per-call overhead decides. This measures, on this
machine, the round trip of one small call (a ~1 KB payload echoed back) three ways, each from an
asyncio caller to another process:

- gRPC unary over loopback (what specd's workers do today: grpc.aio, one channel, kept open);
- a Ray Serve deployment handle (`DeploymentHandle.remote`, the router and replica of Ray Serve);
- a plain Ray actor method call (what Serve's handle is built on).

    .venv/bin/python scripts/measure_serve_latency.py --calls 2000 --out docs/results/serve_latency_zen5.json

Prints p50 / p90 / p99 in microseconds per path; JSON with the machine.
"""

import argparse
import asyncio
import json
import multiprocessing
import time
from pathlib import Path

import grpc
import ray
from ray import serve

from specd.bench.loadtest import machine_info, percentiles

PAYLOAD = bytes(range(256)) * 4  # ~1 KB: a Verify's token ids and a little more
METHOD = "/bench.Echo/Call"


def grpc_server(port: "multiprocessing.Value") -> None:
    """An echo server in a process of its own (the service side of today's data path)."""

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(_echo)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Call": handler}),))
        port.value = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _echo(request: bytes, context) -> bytes:
    return request


@serve.deployment(max_ongoing_requests=64)
class ServeEcho:
    async def __call__(self, payload: bytes) -> bytes:
        return payload


@ray.remote
class ActorEcho:
    async def call(self, payload: bytes) -> bytes:
        return payload


async def timed(call, calls: int) -> list[float]:
    for _ in range(50):  # warm up: connections, the router's first choices
        await call()
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        seconds.append(time.perf_counter() - started)
    return seconds


async def measure(calls: int, port: int) -> dict[str, list[float]]:
    results = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        echo = channel.unary_unary(METHOD)
        results["grpc"] = await timed(lambda: echo(PAYLOAD), calls)
    handle = serve.run(ServeEcho.bind(), name="echo", route_prefix=None)
    results["ray_serve_handle"] = await timed(lambda: handle.remote(PAYLOAD), calls)
    actor = ActorEcho.remote()
    results["ray_actor"] = await timed(lambda: actor.call.remote(PAYLOAD), calls)
    return results


def summary(seconds: list[float]) -> dict[str, float]:
    return {f"{key}_us": value * 1e6 for key, value in percentiles(seconds).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    port = multiprocessing.Value("i", 0)
    server = multiprocessing.Process(target=grpc_server, args=(port,), daemon=True)
    server.start()
    while not port.value:
        time.sleep(0.05)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        results = asyncio.run(measure(args.calls, port.value))
    finally:
        serve.shutdown()
        ray.shutdown()
        server.terminate()
    report = {path: summary(seconds) for path, seconds in results.items()}
    for path, figures in report.items():
        print(f"{path:<18} " + "  ".join(f"{key} {value:8.0f}" for key, value in figures.items()))
    if args.out:
        record = {"calls": args.calls, "paths": report, "machine": machine_info()}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
