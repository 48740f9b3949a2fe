"""`specd serve draft|target|orchestrator`: run one component as a gRPC server."""

import argparse
import asyncio
import logging
import os

from specd.cli.common import (
    UserError,
    add_cuda_graphs_flag,
    add_device_flag,
    add_drafter_flag,
    add_engine_flag,
    add_exactness_flag,
    add_model_flags,
    add_quantize_flag,
    check_service_device,
    draft_tokens_flag,
)
from specd.cli.orchestrator_flags import (
    add_draft_ahead_flag,
    add_orchestrator_limit_flags,
    add_routing_flag,
    policy_from_args,
)
from specd.orchestrator.adaptive import DEFAULT_MAX_DRAFT_TOKENS
from specd.proto import tracing
from specd.proto.auth import add_client_flags, add_server_flags, client_security_from_args, server_security_from_args
from specd.proto.host import DEFAULT_DRAIN_SECONDS
from specd.proto.limits import AUTO_CACHED_TOKENS, AUTO_PREFIX_TOKENS, MAX_Q_BYTES, Limits

DEFAULT_PORTS = {"draft": 50061, "target": 50062, "orchestrator": 50051}
DEFAULT_METRICS_PORTS = {"draft": 9461, "target": 9462, "orchestrator": 9451}  # Prometheus, /metrics
DEFAULT_HTTP_PORT = 8000  # the orchestrator's OpenAI-compatible API


def add_parser(verbs) -> None:
    serve = verbs.add_parser("serve", help="run one component as a gRPC server")
    roles = serve.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role in ("draft", "target"):
        parser = roles.add_parser(role, help=f"the {role} model service")
        parser.add_argument(
            "--model",
            default=role,
            help=f"default-pair name, local HF directory or hub id (default: the {role} of the default pair)",
        )
        _add_address_flags(parser, role)
        add_model_flags(parser)
        add_device_flag(parser, "--device", role)
        add_cuda_graphs_flag(parser, f"the {role}")
        add_engine_flag(parser, "--engine", role)
        add_exactness_flag(parser)
        add_quantize_flag(parser, "--quantize", role)
        _add_limit_flags(parser, role)
        add_prefix_cache_flag(parser)
        add_server_flags(parser)
        add_tracing_flag(parser)
        add_drain_flag(parser, "the requests in flight keep their sessions served; new sessions are refused")
        parser.set_defaults(run=run_model_service)
    parser = roles.add_parser("orchestrator", help="the client-facing SpecDecode server (runs its loops on Ray)")
    parser.add_argument(
        "--draft",
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the draft service; several, comma-separated, are a pool routed like --target's. Leave it out, or "
        "give it empty, to run on the target alone: then only --drafter ngram or suffix guess, in the "
        "orchestrator, and no draft model is needed",
    )
    parser.add_argument(
        "--target",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the target service; several, comma-separated, are a pool of replicas: each new request goes to "
        "one by load and by the prefixes it was sent (orchestrator/router.py) and stays there",
    )
    add_routing_flag(parser)
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray)")
    parser.add_argument("--workers", type=int, default=2, help="Ray generation workers (actors)")
    parser.add_argument(
        "--draft-tokens",
        type=draft_tokens_flag,
        default=None,
        metavar="K|auto",
        help="K when a request does not say (default auto: chosen every step from the measured "
        "acceptance and costs, 0 when speculation does not pay)",
    )
    parser.add_argument(
        "--max-draft-tokens",
        type=int,
        default=DEFAULT_MAX_DRAFT_TOKENS,
        metavar="K",
        help=f"the largest K auto may choose (default {DEFAULT_MAX_DRAFT_TOKENS})",
    )
    add_drafter_flag(parser, "when a request does not say: ")
    add_draft_ahead_flag(parser)
    _add_address_flags(parser, "orchestrator")
    parser.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help=f"port of the OpenAI-compatible HTTP API (default {DEFAULT_HTTP_PORT}; 0 picks a free one)",
    )
    parser.add_argument("--no-http", action="store_true", help="serve gRPC only")
    add_orchestrator_limit_flags(parser)
    add_server_flags(parser)
    add_client_flags(parser, "the services (the orchestrator sends its own --token to them)", token=False)
    add_tracing_flag(parser)
    add_drain_flag(parser, "new requests are refused UNAVAILABLE, HTTP 503; what still runs then ends UNAVAILABLE")
    parser.set_defaults(run=run_orchestrator)


def _add_address_flags(parser, role: str) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORTS[role],
        help=f"port (default {DEFAULT_PORTS[role]}; 0 picks a free one)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORTS[role],
        help=f"port of the Prometheus /metrics endpoint (default {DEFAULT_METRICS_PORTS[role]}; 0 picks a free one)",
    )
    parser.add_argument("--no-metrics", action="store_true", help="no /metrics endpoint")


def add_tracing_flag(parser) -> None:
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces over OTLP/gRPC to this collector, e.g. http://localhost:4317 "
        "(https:// for TLS; default: no tracing)",
    )


def add_drain_flag(parser, what: str) -> None:
    parser.add_argument(
        "--drain-seconds",
        type=_drain_seconds_flag,
        default=DEFAULT_DRAIN_SECONDS,
        metavar="S",
        help=f"on SIGTERM or Ctrl-C, health turns NOT_SERVING and the requests in flight get this long to finish "
        f"before the server exits ({what}; default {DEFAULT_DRAIN_SECONDS:g}, 0: exit at once; a second signal "
        f"cuts the drain short)",
    )


def _drain_seconds_flag(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value}")
    return seconds


def _add_limit_flags(parser, role: str) -> None:
    defaults = Limits()
    parser.add_argument("--max-sessions", type=int, default=defaults.max_sessions, help="live sessions at once")
    parser.add_argument(
        "--max-cached-tokens",
        type=int,
        default=AUTO_CACHED_TOKENS,
        help="KV-cached tokens over all sessions (default 0 = auto: on a GPU, what fits in the device memory "
        "free after loading; on a CPU, 262,144)",
    )
    parser.add_argument(
        "--max-session-tokens",
        type=int,
        default=defaults.max_session_tokens,
        help="longest session (prompt + output + drafts)",
    )
    parser.add_argument("--max-draft-tokens", type=int, default=defaults.max_draft_tokens, help="largest K accepted")
    if role == "draft":
        parser.add_argument(
            "--max-q-bytes",
            type=_q_bytes_flag,
            default=defaults.max_q_bytes,
            metavar="BYTES",
            help=f"most bytes the q rows of one sampled Propose may take (K rows of min(top_k, vocabulary) "
            f"entries; default {defaults.max_q_bytes:,}, at most {MAX_Q_BYTES:,}); a Propose that could take "
            f"more is refused INVALID_ARGUMENT, and the orchestrator asks for a K that fits",
        )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout_s,
        help="seconds before an untouched session is evicted",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=defaults.max_batch_size,
        help="most concurrent calls sharing one forward pass (1: no batching)",
    )
    parser.add_argument(
        "--max-batch-tokens", type=int, default=defaults.max_batch_tokens, help="most new tokens in one batched pass"
    )
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=defaults.batch_wait_ms,
        help="how long a pass may wait for the streams the last pass served to send their next call",
    )


def add_prefix_cache_flag(parser) -> None:
    """--prefix-cache-tokens: a model service's (`specd up`: both services') prefix cache budget."""
    parser.add_argument(
        "--prefix-cache-tokens",
        type=_prefix_tokens_flag,
        default=AUTO_PREFIX_TOKENS,
        metavar="N",
        help="tokens of prompt KV kept past their sessions for reuse (prefix cache); "
        "default: min(16384, max-cached-tokens / 4); 0: off",
    )


def _prefix_tokens_flag(value: str) -> int:
    """--prefix-cache-tokens: a number of tokens >= 0 (or `auto`, the default)."""
    if value.strip().lower() == "auto":
        return AUTO_PREFIX_TOKENS
    try:
        tokens = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens (0: off), got {value!r}") from None
    if tokens < 0:
        raise argparse.ArgumentTypeError(f"must be a number of tokens >= 0 (0: off), got {tokens}")
    return tokens


def _q_bytes_flag(value: str) -> int:
    """--max-q-bytes: 1..MAX_Q_BYTES (the rows must fit in the gRPC messages that carry them)."""
    try:
        limit = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {value!r}") from None
    if not 1 <= limit <= MAX_Q_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be in 1..{MAX_Q_BYTES} (half the {2 * MAX_Q_BYTES}-byte gRPC message limit), got {limit}"
        )
    return limit


def _security(args, client: bool = False):
    try:
        return client_security_from_args(args) if client else server_security_from_args(args)
    except ValueError as error:
        raise UserError(str(error)) from error


def limits_from_args(args) -> Limits:
    return Limits(
        max_sessions=args.max_sessions,
        max_cached_tokens=args.max_cached_tokens,
        max_session_tokens=args.max_session_tokens,
        max_draft_tokens=args.max_draft_tokens,
        idle_timeout_s=args.idle_timeout,
        max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens,
        batch_wait_ms=args.batch_wait_ms,
        max_q_bytes=getattr(args, "max_q_bytes", Limits().max_q_bytes),  # a draft's only
        prefix_cache_tokens=args.prefix_cache_tokens,
    )


def let_ggml_threads_spin(args: argparse.Namespace) -> None:
    """Drop OMP_WAIT_POLICY=PASSIVE (`specd up` sets it for torch's threads, deploy/local.py) in a
    service that will run the llama.cpp engine (`--engine llama.cpp`, or auto with the model's GGUF
    at hand, not on a GPU). ggml's CPU threads meet at an OpenMP barrier after every op, hundreds a
    token, and under PASSIVE each barrier puts them to sleep and wakes them: a decode step of the
    default target took 43 ms against 28 (AMD EPYC Zen 5, 2 threads). ggml shares torch's libgomp
    (one soname), which reads the variable once, when torch loads: hence here, before that. Without
    it, libgomp spins a moment at a barrier, then sleeps."""
    from specd.model.store import find_gguf  # torch-free

    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        return
    on_gpu = (args.device or "auto").strip().lower().startswith("cuda")
    if args.engine == "llama.cpp" or (args.engine == "auto" and not on_gpu and find_gguf(args.model)):
        del os.environ["OMP_WAIT_POLICY"]


def run_model_service(args: argparse.Namespace) -> int:
    let_ggml_threads_spin(args)  # before torch loads libgomp
    from specd.deploy.roles import RoleConfig
    from specd.deploy.services import model_server
    from specd.model.cpu_blas import preload_on_amd
    from specd.serving.server import serve_until_signal

    preload_on_amd()  # on an AMD CPU: this process again, with MKL's fast kernels (model/cpu_blas.py)
    check_service_device(args.role, args)  # one line and exit 2 before anything starts, e.g. no GPU here
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tracing.setup(args.otlp_endpoint, f"specd-{args.role}")  # before the server: its calls get spans
    settings = RoleConfig(args.model, args.quantize, args.device, args.cuda_graphs, args.engine, args.threads)
    server = model_server(args.role, settings, args.dtype, limits_from_args(args), args.exactness)
    asyncio.run(
        serve_until_signal(
            server,
            f"{args.host}:{args.port}",
            security=_security(args),
            metrics_host=args.host,
            metrics_port=None if args.no_metrics else args.metrics_port,
            drain_seconds=args.drain_seconds,
        )
    )
    return 0


def run_orchestrator(args: argparse.Namespace) -> int:
    import ray

    from specd.orchestrator.server import OrchestratorServer, serve_until_signal

    policy = policy_from_args(args)
    security, service_security = _security(args), _security(args, client=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")  # drain lines
    tracing.setup(args.otlp_endpoint, "specd-orchestrator")  # this process; the Ray workers set up their own
    try:
        server = OrchestratorServer(
            args.draft or None,
            args.target,
            workers=args.workers,
            default_draft_tokens=args.draft_tokens,
            max_draft_tokens=args.max_draft_tokens,
            drafter=args.drafter,
            draft_ahead=args.draft_ahead,
            routing=args.routing,
            migration_limit=args.migration_limit,
            policy=policy,
            security=security,
            service_security=service_security,
            max_concurrent_requests=args.max_concurrent_requests,
            max_prompt_tokens=args.max_prompt_tokens,
            otlp_endpoint=args.otlp_endpoint,
        )
    except ValueError as error:  # e.g. no --draft for a drafter that needs one: before Ray starts
        raise UserError(str(error)) from error
    start_ray(args.ray_address)
    try:
        asyncio.run(
            serve_until_signal(
                server,
                f"{args.host}:{args.port}",
                http_port=None if args.no_http else args.http_port,
                metrics_port=None if args.no_metrics else args.metrics_port,
                drain_seconds=args.drain_seconds,
            )
        )
    finally:
        ray.shutdown()
    return 0


def start_ray(address: str | None) -> None:
    """Join a cluster, or start a small local Ray (no dashboard: nothing extra to install)."""
    import ray

    if address:
        ray.init(address=address, logging_level="WARNING")
    else:
        ray.init(include_dashboard=False, object_store_memory=256 * 1024 * 1024, logging_level="WARNING")
