"""The orchestrator's process: the composition root that connects the pair, starts the Ray workers
and the core, and hosts both transports over it, gRPC (grpc_api.py: specd.v1.SpecDecode, and the
Replicas service, scaling.py) and the OpenAI-compatible HTTP API (openai_api.py), with health, drain
and metrics. Neither transport imports the other."""

import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.orchestrator.adaptive import DEFAULT_MAX_DRAFT_TOKENS
from specd.orchestrator.ahead import DEFAULT_DRAFT_AHEAD
from specd.orchestrator.core import Core
from specd.orchestrator.faults import FaultPolicy
from specd.orchestrator.grpc_api import REPLICAS_SERVICE_NAME, SERVICE_NAME, SpecDecodeServicer
from specd.orchestrator.lookup import DEFAULT_DRAFTER, LOOKUP_ONLY
from specd.orchestrator.metrics import OrchestratorMetrics
from specd.orchestrator.migration import MIGRATION_LIMIT
from specd.orchestrator.openai_api import HttpApi
from specd.orchestrator.remote import connect_pair
from specd.orchestrator.router import ROUTINGS
from specd.orchestrator.scaling import ReplicasServicer
from specd.orchestrator.worker import WorkerPool, replicas
from specd.proto.auth import ClientSecurity, ServerSecurity
from specd.proto.host import DEFAULT_DRAIN_SECONDS, stop_on_signals
from specd.proto.metrics import start_exporter
from specd.v1 import specdecode_pb2_grpc

STOP_GRACE_S = 1.0  # after the drain, how long gRPC calls still open get before they are cancelled

log = logging.getLogger("specd.orchestrator")


class OrchestratorServer:
    """The SpecDecode server: connect to the pair, start the Ray workers, serve.

    `draft_address` None (or empty): the target alone, where only the lookup drafters guess
    (`drafter` ngram or suffix; hybrid and model need the draft, and are refused at once)."""

    def __init__(
        self,
        draft_address: str | None,
        target_address: str,
        workers: int = 2,
        default_draft_tokens: int | None = None,
        policy: FaultPolicy = FaultPolicy(),
        security: ServerSecurity = ServerSecurity(),
        service_security: ClientSecurity = ClientSecurity(),
        max_concurrent_requests: int | None = None,
        max_prompt_tokens: int | None = None,
        max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
        drafter: str = DEFAULT_DRAFTER,
        otlp_endpoint: str | None = None,
        draft_ahead: str = DEFAULT_DRAFT_AHEAD,
        routing: str = ROUTINGS[0],
        migration_limit: int = MIGRATION_LIMIT,
    ):
        if not draft_address and drafter not in LOOKUP_ONLY:
            raise ValueError(
                f"--drafter {drafter} guesses with the draft model, which needs --draft HOST:PORT; "
                f"without a draft service choose --drafter {' or '.join(LOOKUP_ONLY)}"
            )
        self.policy = policy  # per-call caps, target retries, draft back-off (faults.py)
        self.security = security  # this server's token and TLS
        self.service_security = service_security  # the token and CA it uses towards the services
        self.limits = (max_concurrent_requests, max_prompt_tokens)  # None = unlimited
        self.addresses = (draft_address or None, target_address)
        self.workers = workers
        self.default_draft_tokens = default_draft_tokens  # None: adaptive
        self.max_draft_tokens = max_draft_tokens
        self.drafter = drafter  # for requests that leave it empty (lookup.py)
        self.draft_ahead = draft_ahead  # for requests that leave it empty (ahead.py)
        self.routing = routing  # how the pools of replicas place new requests (router.py)
        self.migration_limit = migration_limit  # moves per request off failed target replicas (migration.py)
        self.otlp_endpoint = otlp_endpoint  # where the Ray workers send their spans (proto/tracing.py); None: off
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.pool: WorkerPool | None = None
        self.port = 0
        self.metrics = OrchestratorMetrics()
        self.core: Core | None = None  # what both APIs call (core.py)
        self.servicer: SpecDecodeServicer | None = None
        self.http: HttpApi | None = None  # the OpenAI-compatible HTTP API, when started

    async def start(self, address: str = "127.0.0.1:0") -> int:
        draft_address, target_address = self.addresses
        # The served pair's facts (tokenizer, limits, Info) from the first replicas; every worker checks
        # each draft replica against each target replica when it connects (worker.py)
        first_draft = replicas(draft_address)[0] if draft_address else None
        pair = await connect_pair(first_draft, replicas(target_address)[0], security=self.service_security)
        self.pool = WorkerPool(
            *self.addresses,
            workers=self.workers,
            policy=self.policy,
            security=self.service_security,
            max_requests=self.limits[0],
            otlp_endpoint=self.otlp_endpoint,
            routing=self.routing,
            metrics=self.metrics,
            migration_limit=self.migration_limit,
        )
        await self.pool.ready()
        self.server = grpc.aio.server(interceptors=self.security.interceptors())
        self.core = Core(
            pair,
            self.pool,
            self.default_draft_tokens,
            self.metrics,
            max_prompt_tokens=self.limits[1],
            max_draft_tokens=self.max_draft_tokens,
            drafter=self.drafter,
            draft_ahead=self.draft_ahead,
        )
        self.servicer = SpecDecodeServicer(self.core)
        specdecode_pb2_grpc.add_SpecDecodeServicer_to_server(self.servicer, self.server)
        scaling = ReplicasServicer(self.pool, pair, self.service_security)
        specdecode_pb2_grpc.add_ReplicasServicer_to_server(scaling, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE_NAME, REPLICAS_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.port = self.security.bind(self.server, address)
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def start_http(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """After start(): the OpenAI-compatible HTTP API on the same core; returns its port."""
        security = self.security
        self.http = HttpApi(
            self.core, token=security.token, tls=(security.tls_cert, security.tls_key) if security.tls_cert else None
        )
        return await self.http.start(host, port)

    async def stop(self, drain_seconds: float = DEFAULT_DRAIN_SECONDS) -> None:
        """Drain, then stop (drain.py): refuse new requests (UNAVAILABLE, health NOT_SERVING, HTTP 503),
        let those in flight finish within `drain_seconds` (0: none), end the rest UNAVAILABLE, close."""
        await self.health.enter_graceful_shutdown()  # NOT_SERVING for "" and SERVICE_NAME, and it stays so
        if self.http:
            self.http.api.draining = True
        if self.core:
            drain, started = self.core.drain, time.monotonic()
            log.info(
                "draining: refusing new requests, %d in flight, waiting up to %g s for them (--drain-seconds)",
                len(drain.in_flight),
                drain_seconds,
            )
            finished, cut = await drain.drain(drain_seconds)
            log.info("drained in %.1f s, requests: %d finished, %d cut", time.monotonic() - started, finished, cut)
        if self.http:
            await self.http.stop()
        if self.server:
            await self.server.stop(STOP_GRACE_S)
        if self.pool:
            self.pool.shutdown()

    def hurry(self) -> None:
        """End a drain under way now (a second signal): cut the requests still running."""
        if self.core:
            self.core.drain.hurry()


async def serve_until_signal(
    server: OrchestratorServer,
    address: str,
    http_port: int | None = None,
    metrics_port: int | None = None,
    drain_seconds: float = DEFAULT_DRAIN_SECONDS,
) -> None:
    """gRPC on `address`; the HTTP API and the metrics exporter on the same host (None = not started).
    SIGINT/SIGTERM drains for up to `drain_seconds`, then stops; a second one cuts the drain short."""
    stop = stop_on_signals(server.hurry)
    port = await server.start(address)
    host = address.rsplit(":", 1)[0].strip("[]")
    if http_port is not None:
        http_port = await server.start_http(host, http_port)
        print(f"OpenAI-compatible HTTP API on http://{host}:{http_port}/v1", flush=True)
    if metrics_port is not None:
        exporter = start_exporter(server.metrics.registry, host, metrics_port)
        print(f"{SERVICE_NAME} metrics on http://{host}:{exporter.server_port}/metrics", flush=True)
    print(f"{SERVICE_NAME} ready on port {port}", flush=True)
    await stop.wait()
    await server.stop(drain_seconds)
