"""`specd up`: draft, target and orchestrator on this machine, or on a Ray cluster, until Ctrl-C."""

import argparse
import asyncio
import signal

from specd.cli.common import add_model_flags, add_quantize_flag
from specd.cli.serve import DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORTS, DEFAULT_PORTS


def add_parser(verbs) -> None:
    parser = verbs.add_parser(
        "up",
        help="run the whole stack on this machine (three processes), or on a Ray "
        "cluster with --ray-address, until Ctrl-C",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS["orchestrator"], help="the orchestrator's port")
    parser.add_argument("--draft-port", type=int, default=DEFAULT_PORTS["draft"])
    parser.add_argument("--target-port", type=int, default=DEFAULT_PORTS["target"])
    parser.add_argument(
        "--http-port", type=int, default=DEFAULT_HTTP_PORT, help="the OpenAI-compatible HTTP API's port"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORTS["orchestrator"],
        help="the orchestrator's Prometheus /metrics port",
    )
    parser.add_argument("--draft-metrics-port", type=int, default=DEFAULT_METRICS_PORTS["draft"])
    parser.add_argument("--target-metrics-port", type=int, default=DEFAULT_METRICS_PORTS["target"])
    parser.add_argument("--draft-model", default="draft", help="default-pair name, local HF directory or hub id")
    parser.add_argument("--target-model", default="target", help="default-pair name, local HF directory or hub id")
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="deploy the whole stack onto this running Ray cluster (`auto`: the one `ray start` made "
        "here): the draft on a node with a `draft` resource, the target on one with a `target` "
        "resource or a GPU, each server in a Ray actor that Ray restarts",
    )
    parser.add_argument("--workers", type=int, default=2, help="Ray generation workers (per orchestrator replica)")
    cluster = parser.add_argument_group("with --ray-address")
    cluster.add_argument(
        "--replicas", type=int, default=1, help="orchestrator replicas (replica i adds i to each port)"
    )
    cluster.add_argument(
        "--draft-address",
        default=None,
        metavar="HOST:PORT",
        help="where the orchestrator reaches the draft (a proxy, a Kubernetes Service; default: its node)",
    )
    cluster.add_argument(
        "--target-address",
        default=None,
        metavar="HOST:PORT",
        help="where the orchestrator reaches the target (default: its node)",
    )
    cluster.add_argument("--health-period", type=float, default=5.0, metavar="S", help="seconds between health checks")
    cluster.add_argument(
        "--restart-after",
        type=float,
        default=60.0,
        metavar="S",
        help="a server that answers no health check for this long is killed, and Ray restarts it",
    )
    add_model_flags(parser)
    add_quantize_flag(parser, "--draft-quantize", "draft")
    add_quantize_flag(parser, "--target-quantize", "target")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the stack like Ctrl-C
    return run_on_cluster(args) if args.ray_address else run_here(args)


def run_on_cluster(args: argparse.Namespace) -> int:
    from specd.deploy.cluster import ClusterConfig, ClusterStack

    stack = ClusterStack(
        ClusterConfig(
            ray_address=args.ray_address,
            draft_model=args.draft_model,
            target_model=args.target_model,
            dtype=args.dtype,
            threads=args.threads,
            draft_quantize=args.draft_quantize,
            target_quantize=args.target_quantize,
            draft_port=args.draft_port,
            target_port=args.target_port,
            port=args.port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            draft_metrics_port=args.draft_metrics_port,
            target_metrics_port=args.target_metrics_port,
            replicas=args.replicas,
            workers=args.workers,
            draft_address=args.draft_address,
            target_address=args.target_address,
            health_period_s=args.health_period,
            restart_after_s=args.restart_after,
        )
    )
    try:
        asyncio.run(stack.start())
        for deployed in stack.deployed:
            print(f"{deployed.name:<15} {deployed.address:<21} pid {deployed.pid}", flush=True)
        print(
            f"ready: specd generate 'def fibonacci(n):' --server {stack.address}   (Ctrl-C stops the stack)", flush=True
        )
        asyncio.run(stack.watch())
    except KeyboardInterrupt:
        print("stopping")
    finally:
        stack.stop()
    return 0


def run_here(args: argparse.Namespace) -> int:
    from specd.deploy.local import LocalStack, StackConfig

    stack = LocalStack(
        StackConfig(
            dtype=args.dtype,
            threads=args.threads,
            draft_model=args.draft_model,
            target_model=args.target_model,
            draft_port=args.draft_port,
            target_port=args.target_port,
            port=args.port,
            http_port=args.http_port,
            draft_metrics_port=args.draft_metrics_port,
            target_metrics_port=args.target_metrics_port,
            metrics_port=args.metrics_port,
            workers=args.workers,
            draft_quantize=args.draft_quantize,
            target_quantize=args.target_quantize,
        )
    )
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
