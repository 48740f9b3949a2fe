"""`specd up`: draft, target and orchestrator on this machine until Ctrl-C."""

import argparse
import asyncio
import signal

from specd.cli.common import add_model_flags
from specd.cli.serve import DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORTS, DEFAULT_PORTS


def add_parser(verbs) -> None:
    parser = verbs.add_parser("up", help="run the whole stack on this machine (three processes) until Ctrl-C")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS["orchestrator"], help="the orchestrator's port")
    parser.add_argument("--draft-port", type=int, default=DEFAULT_PORTS["draft"])
    parser.add_argument("--target-port", type=int, default=DEFAULT_PORTS["target"])
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="the OpenAI-compatible HTTP API's port")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORTS["orchestrator"],
                        help="the orchestrator's Prometheus /metrics port")
    parser.add_argument("--draft-metrics-port", type=int, default=DEFAULT_METRICS_PORTS["draft"])
    parser.add_argument("--target-metrics-port", type=int, default=DEFAULT_METRICS_PORTS["target"])
    parser.add_argument("--draft-model", default="draft", help="default-pair name, local HF directory or hub id")
    parser.add_argument("--target-model", default="target", help="default-pair name, local HF directory or hub id")
    parser.add_argument("--ray-address", default=None, help="run the orchestrator's workers on this Ray cluster")
    parser.add_argument("--workers", type=int, default=2, help="Ray generation workers")
    add_model_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specd.deploy.local import LocalStack, StackConfig

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the stack like Ctrl-C

    stack = LocalStack(StackConfig(
        dtype=args.dtype, threads=args.threads, draft_model=args.draft_model, target_model=args.target_model,
        draft_port=args.draft_port, target_port=args.target_port, port=args.port, http_port=args.http_port,
        draft_metrics_port=args.draft_metrics_port, target_metrics_port=args.target_metrics_port,
        metrics_port=args.metrics_port,
        ray_address=args.ray_address, workers=args.workers,
    ))
    try:
        asyncio.run(stack.start())
        for child in stack.children:
            print(f"{child.name:<13} {child.address:<17} metrics {child.metrics_url}")
        print(f"{'OpenAI API':<13} {stack.http_url}   (curl {stack.http_url}/models)")
        print(f"ready: specd generate 'def fibonacci(n):' --server {stack.address}   (Ctrl-C stops all three)")
        asyncio.run(_forever())
    except KeyboardInterrupt:
        print("stopping")
    finally:
        stack.stop()
    return 0


async def _forever() -> None:
    await asyncio.Event().wait()
