"""`specd up`: draft, target and orchestrator on this machine, or on a Ray cluster, until Ctrl-C."""

import argparse
import asyncio
import signal
from pathlib import Path

from specd.cli.common import (
    STACK_DEVICE_FLAGS,
    UserError,
    add_drafter_flag,
    add_exactness_flag,
    add_model_flags,
    add_quantize_flag,
    add_stack_device_flags,
    check_stack_devices,
    measured_choice,
    roles_from_args,
)
from specd.cli.orchestrator_flags import (
    add_draft_ahead_flag,
    add_orchestrator_limit_flags,
    add_routing_flag,
    policy_from_args,
)
from specd.cli.serve import (
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORTS,
    DEFAULT_PORTS,
    _add_limit_flags,
    add_drain_flag,
    add_prefix_cache_flag,
    add_tracing_flag,
    limits_from_args,
)
from specd.proto.auth import ClientSecurity, add_client_flags, add_server_flags, server_security_from_args
from specd.proto.limits import AUTO_PREFIX_TOKENS


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
    parser.add_argument(
        "--target-replicas",
        type=int,
        default=1,
        metavar="N",
        help="target services (replica i on --target-port + 100 i; with --ray-address each an actor Ray places, "
        "on a GPU of its own where there are GPUs), each orchestrator routing every new request to one of them "
        "by load and by the prefixes it was sent (orchestrator/router.py). With --engine sim they test routing "
        "on a small machine",
    )
    parser.add_argument(
        "--draft-replicas",
        type=int,
        default=1,
        metavar="M",
        help="draft services (replica i on --draft-port + 100 i), routed alike: each new request whose drafter "
        "asks the draft goes to one",
    )
    add_drafter_flag(parser, "the orchestrator's default (ngram or suffix: the stack runs no draft service); ")
    add_draft_ahead_flag(parser)
    add_routing_flag(parser)
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
    cluster.add_argument(
        "--target-gpus",
        type=float,
        default=0,
        metavar="N",
        help="GPUs the target's actor asks Ray for (num_gpus; default 0: none in Ray's accounting, except a "
        "target placed by GPU, on a cluster without a `target` resource, asks for 1). With N >= 1 Ray "
        "assigns the actor its own GPU(s) and --device auto is the first of them (cuda:0 inside the actor)",
    )
    add_model_flags(parser)
    parser.add_argument(
        "--draft-threads",
        type=int,
        default=None,
        metavar="N",
        help="the draft's torch threads (default: --threads, else a quarter of the cores, at least 1, "
        "when both services compute on the CPU: docs/deploying/one-machine.md)",
    )
    parser.add_argument(
        "--target-threads",
        type=int,
        default=None,
        metavar="N",
        help="the target's torch threads (default: --threads, else every core)",
    )
    add_stack_device_flags(parser)
    add_quantize_flag(parser, "--draft-quantize", "draft")
    add_quantize_flag(parser, "--target-quantize", "target")
    add_prefix_cache_flag(parser)  # both services', here and on a cluster
    add_exactness_flag(parser, "both services': ")
    add_tracing_flag(parser)  # passed to all three processes (every actor, on a cluster)
    add_drain_flag(parser, "passed to all three processes of a stack on this machine")
    add_cluster_security_and_limit_flags(parser)
    parser.set_defaults(run=run)


def add_cluster_security_and_limit_flags(parser: argparse.ArgumentParser) -> None:
    """`specd serve`'s token, TLS, limit and fault-policy flags, for every actor of a cluster; their
    names are kept (`cluster_only`) to refuse them on a stack here, which does not pass them on yet."""
    group = parser.add_argument_group(
        "security and limits, with --ray-address (as `specd serve` takes them; the token, the certificate "
        "and the key reach every actor as constructor arguments, never on a command line)"
    )
    add_server_flags(group)
    add_client_flags(group, "the servers (default: --tls-cert, a self-signed certificate is its own CA)", token=False)
    _add_limit_flags(group, "draft")  # --max-q-bytes is the draft's; the others both services'
    add_orchestrator_limit_flags(group)
    parser.set_defaults(cluster_only={action.option_strings[0]: action for action in group._group_actions})


def run(args: argparse.Namespace) -> int:
    if args.target_gpus < 0:
        raise UserError("--target-gpus must be >= 0")
    for flag in ("--threads", "--draft-threads", "--target-threads"):
        if (value := getattr(args, flag[2:].replace("-", "_"))) is not None and value < 1:
            raise UserError(f"{flag} must be >= 1")
    given = [flag for flag, action in args.cluster_only.items() if getattr(args, action.dest) != action.default]
    if given and not args.ray_address:
        raise UserError(
            f"{', '.join(given)}: a stack on this machine does not pass these on yet; they are for --ray-address "
            "(or start each component with `specd serve` and its flags)"
        )
    for role in ("target", "draft"):
        if getattr(args, f"{role}_replicas") < 1:
            raise UserError(f"--{role}-replicas must be >= 1")
    if args.ray_address and args.draft_ahead != "auto":
        raise UserError("--draft-ahead is for a stack on this machine; on a cluster a request sets draft_ahead")
    if args.ray_address and (args.draft_threads or args.target_threads):
        raise UserError(
            "--draft-threads and --target-threads are for a stack on this machine; on a cluster use --threads"
        )
    # Before anything starts: a device that does not exist here is one line and exit 2. On a
    # cluster each service resolves its device on its own node; only the form is checked here.
    graphs = check_stack_devices(args, here=not args.ray_address)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the stack like Ctrl-C
    return run_on_cluster(args, graphs) if args.ray_address else run_here(args, graphs)


def run_on_cluster(args: argparse.Namespace, graphs: dict[str, str]) -> int:
    from specd.deploy.cluster import ClusterConfig, ClusterStack
    from specd.orchestrator.adaptive import DEFAULT_MAX_DRAFT_TOKENS

    security, service_security = cluster_security(args)
    stack = ClusterStack(
        ClusterConfig(
            ray_address=args.ray_address,
            **roles_from_args(args, graphs),
            dtype=args.dtype,
            threads=args.threads,
            exactness=args.exactness,
            target_gpus=args.target_gpus,
            port=args.port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            replicas=args.replicas,
            routing=args.routing,
            migration_limit=args.migration_limit,
            workers=args.workers,
            draft_address=args.draft_address,
            target_address=args.target_address,
            health_period_s=args.health_period,
            restart_after_s=args.restart_after,
            limits=limits_from_args(args),
            security=security,
            service_security=service_security,
            policy=policy_from_args(args),
            max_concurrent_requests=args.max_concurrent_requests,
            max_prompt_tokens=args.max_prompt_tokens,
            # --max-draft-tokens is the largest K the services accept; auto chooses within it and its own bound
            max_draft_tokens=min(args.max_draft_tokens, DEFAULT_MAX_DRAFT_TOKENS),
            drafter=args.drafter,
            otlp_endpoint=args.otlp_endpoint,
        )
    )
    try:
        asyncio.run(stack.start())
        for deployed in stack.deployed:
            print(f"{deployed.name:<15} {deployed.address:<21} pid {deployed.pid}", flush=True)
        print_devices(stack.address, service_security)
        print(
            f"ready: specd generate 'def fibonacci(n):' --server {stack.address}   (Ctrl-C stops the stack)", flush=True
        )
        asyncio.run(stack.watch())
    except KeyboardInterrupt:
        print("stopping")
    finally:
        stack.stop()
    return 0


def cluster_security(args: argparse.Namespace) -> tuple:
    """(ServerSecurity, ClientSecurity) of a cluster's servers from --token (or SPECD_TOKEN), --tls-cert,
    --tls-key and --tls-ca: the files read here, so the actors get PEM bytes and their nodes need no files.
    One certificate for every server; without --tls-ca the clients trust --tls-cert itself."""
    if args.tls_ca and not args.tls_cert:
        raise UserError("--tls-ca needs --tls-cert and --tls-key: the servers of a cluster serve TLS or none")
    try:
        security = server_security_from_args(args)
        ca = Path(args.tls_ca).read_bytes() if args.tls_ca else security.tls_cert
    except ValueError as error:
        raise UserError(str(error)) from error
    except OSError as error:
        raise UserError(f"cannot read {args.tls_ca}: {error.strerror}") from error
    return security, ClientSecurity(security.token, ca)


def run_here(args: argparse.Namespace, graphs: dict[str, str]) -> int:
    from specd.deploy.local import SHARED_CORES_ENV, LocalStack, StackConfig

    roles, drafter = measured_choice(args, roles_from_args(args, graphs, service_threads(args)), args.drafter)
    stack = LocalStack(
        StackConfig(
            dtype=args.dtype,
            **roles,
            service_env=SHARED_CORES_ENV,
            port=args.port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            workers=args.workers,
            drafter=drafter,
            draft_ahead=args.draft_ahead,
            routing=args.routing,
            migration_limit=args.migration_limit,
            step_deadline=args.step_deadline,
            otlp_endpoint=args.otlp_endpoint,
            drain_seconds=args.drain_seconds,
            prefix_cache_tokens=None if args.prefix_cache_tokens == AUTO_PREFIX_TOKENS else args.prefix_cache_tokens,
            exactness=args.exactness,
        )
    )
    try:
        asyncio.run(stack.start())
        for child in stack.children:
            print(f"{child.name:<13} {child.address:<17} metrics {child.metrics_url}")
        print_devices(stack.address)
        print(f"{'OpenAI API':<13} {stack.http_url}   (curl {stack.http_url}/models)")
        print(f"ready: specd generate 'def fibonacci(n):' --server {stack.address}   (Ctrl-C stops the stack)")
        asyncio.run(_forever())
    except KeyboardInterrupt:
        print(f"stopping: requests in flight get up to {args.drain_seconds:g} s to finish (Ctrl-C again: at once)")
    finally:
        stack.stop()
    return 0


def service_threads(args: argparse.Namespace) -> dict[str, int | None]:
    """Torch threads of the draft and the target that `specd up` (and `specd generate`'s own stack) runs
    here: --draft-threads and --target-threads, else --threads, else their share of this machine's
    cores for each one that computes on the CPU (`share_cores`: the target all of them, the draft a
    quarter; docs/deploying/one-machine.md). None: the service's own default (all cores), for a
    service on a GPU."""
    from specd.deploy.local import share_cores, usable_cores

    given = {role: getattr(args, f"{role}_threads", None) or args.threads for role in ("draft", "target")}
    if all(given.values()):
        return given
    shared = share_cores(usable_cores(), on_cpu=[role for role in given if computes_on_cpu(role, args)])
    return {role: given[role] or shared.get(role) for role in given}


def computes_on_cpu(role: str, args: argparse.Namespace) -> bool:
    """Whether the service `role` of a stack here computes on the CPU (docs/architecture.md §4: `auto`
    keeps the draft on the CPU and puts the target on a GPU where torch sees one)."""
    choice = getattr(args, STACK_DEVICE_FLAGS[role][2:].replace("-", "_"))
    if choice != "auto" or role == "draft":
        return choice in ("auto", "cpu")
    from specd.model.devices import resolve_device  # torch, only for a target placed by `auto`

    return resolve_device(role, choice).type == "cpu"


async def _forever() -> None:
    await asyncio.Event().wait()


def print_devices(address: str, security: ClientSecurity = ClientSecurity()) -> None:
    """One line per model service: its device, the device's name, dtype and memory (the orchestrator's
    Info relays each service's ModelInfo as it answers now; a stack without a draft has no draft line)."""
    try:
        infos = asyncio.run(_service_infos(address, security))
    except Exception as error:  # the stack runs regardless: this is only a report
        print(f"(could not read the services' devices: {error})", flush=True)
        return
    for info in infos:
        print(describe_device(info), flush=True)


async def _service_infos(address: str, security: ClientSecurity) -> list:
    from specd.proto.client import channel
    from specd.v1 import common_pb2, specdecode_pb2_grpc

    async with channel(address, security) as open_channel:
        info = await specdecode_pb2_grpc.SpecDecodeStub(open_channel).Info(common_pb2.InfoRequest(), timeout=10)
    return [info.draft, info.target] if info.HasField("draft") else [info.target]


def describe_device(info) -> str:
    """`target  cuda:0 (NVIDIA H200), bfloat16, memory 131.2 of 139.8 GiB free` from a ModelInfo
    (a CPU's: `draft  cpu (AMD EPYC), bfloat16 int4, host memory 21.3 of 23.5 GiB free`)."""
    quantized = f" {info.quantization}" if info.quantization not in ("", "none") else ""
    host = "host " if info.device == "cpu" else ""
    memory = (
        f"{host}memory {_gib(info.device_memory_free_bytes)} of {_gib(info.device_memory_total_bytes)} GiB free"
        if info.device_memory_total_bytes
        else "memory unknown"
    )
    name = f" ({info.device_name})" if info.device_name else ""
    passes = info.pass_seconds  # as measured when it loaded (model/pass_profile.py): a decode, a verify of K = 3
    scored = f"; 1 / 4 scored positions {passes[0] * 1000:.0f} / {passes[3] * 1000:.0f} ms" if len(passes) >= 4 else ""
    if info.scored_per_call:  # llama.cpp bitwise: 63 with the patched ggml-cpu, 3 without (troubleshooting)
        scored += f"; up to {info.scored_per_call} scored a call"
    return f"{info.role:<13} {info.device or '?'}{name}, {info.dtype}{quantized}, {memory}{scored}"


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f}"
