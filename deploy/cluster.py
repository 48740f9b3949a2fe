"""The whole stack on an existing Ray cluster: every server runs inside a Ray actor.

1. Place: the draft on a node offering a `draft` resource (else any node; none for a drafter that
   only looks up, ngram or suffix), the target on a
   node offering a `target` resource, else one with a GPU, else any node; orchestrator
   replicas on nodes offering `orchestrator`, else anywhere. A target actor that asks Ray for
   GPUs (`target_gpus`, or 1 when it is placed by GPU) sees only the GPU(s) Ray assigned it, so
   its `--device auto` is cuda:0 inside the actor; each service resolves its device on its node.
2. Start: each actor binds its gRPC server (0.0.0.0, a fixed port) in its constructor, so a
   restarted actor serves again on its own; the deployer waits for grpc.health.v1 SERVING.
3. Watch: Ray restarts an actor whose process dies (max_restarts=-1); the deployer also
   health-checks every server and kills an actor silent for `restart_after_s`, so Ray restarts it.
The actors belong to the deploying process: stopping it (Ctrl-C) stops the stack.

Every actor gets what `specd serve` gets from its flags, as its constructor's arguments: its limits,
the orchestrator's fault policy, the OTLP endpoint (each actor sets up tracing in its own process),
and the token and TLS certificate, key and CA as PEM bytes the deployer read. Arguments, not a
command line or a runtime env (which `ray list actors --detail` shows): the token never appears in
`ps`, and a node needs no certificate files; Ray keeps the arguments to restart the actor with them.
"""

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field, replace

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.deploy.local import REPLICA_PORT_STEP
from specd.deploy.roles import RoleConfig
from specd.orchestrator.adaptive import DEFAULT_MAX_DRAFT_TOKENS
from specd.orchestrator.faults import FaultPolicy
from specd.orchestrator.lookup import DEFAULT_DRAFTER, LOOKUP_ONLY
from specd.orchestrator.migration import MIGRATION_LIMIT
from specd.orchestrator.remote import wait_until_serving
from specd.orchestrator.router import ROUTINGS
from specd.proto.auth import ClientSecurity, ServerSecurity
from specd.proto.limits import AUTO_CACHED_TOKENS, Limits


@dataclass
class ClusterConfig:
    ray_address: str  # any node of the cluster, e.g. 10.0.0.1:6379, or "auto"
    # Each role's model, engine settings, ports and replicas (deploy/roles.py), resolved on the service's
    # node: device auto is cuda:0 of the actor when its node (or Ray) gives it a GPU, else cpu; quantize
    # auto is int4 for a draft without a GPU. Replica i listens on its role's ports + REPLICA_PORT_STEP i.
    draft: RoleConfig = field(default_factory=lambda: RoleConfig("draft", port=50061, metrics_port=9461))
    target: RoleConfig = field(default_factory=lambda: RoleConfig("target", port=50062, metrics_port=9462))
    dtype: str | None = None
    threads: int | None = None  # torch threads per model service (default: the node's cores)
    exactness: str = "bitwise"  # both model services' --exactness (proto/limits.py EXACTNESS)
    # GPUs the target's actor asks Ray for (num_gpus). 0: none in Ray's accounting (Ray 2.60 then leaves
    # CUDA_VISIBLE_DEVICES alone: the actor sees every GPU of its node), except that a target placed by
    # GPU (no `target` resource in the cluster) asks for 1. With >= 1 Ray assigns it its own GPU(s).
    target_gpus: float = 0
    # max_cached_tokens 0: each service derives it from its device (as `specd serve` does by default)
    limits: Limits = field(default_factory=lambda: Limits(max_cached_tokens=AUTO_CACHED_TOKENS))
    # Every server's token and TLS (PEM bytes), and what the orchestrator and the deployer use towards
    # them: the same token, the CA. Default: open, plaintext.
    security: ServerSecurity = field(default_factory=ServerSecurity)
    service_security: ClientSecurity = field(default_factory=ClientSecurity)
    # The orchestrator's own flags (`specd serve orchestrator`): fault policy, admission, K, drafter.
    policy: FaultPolicy = field(default_factory=FaultPolicy)
    max_concurrent_requests: int | None = None  # None: no limit
    max_prompt_tokens: int | None = None  # None: what a session holds
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS  # the largest K auto chooses
    drafter: str = DEFAULT_DRAFTER
    otlp_endpoint: str | None = None  # the OpenTelemetry collector every actor sends its spans to; None: off
    port: int = 50051  # the orchestrator's gRPC port (replica i listens on port + i)
    http_port: int | None = 8000  # its OpenAI-compatible API (+ i); None = gRPC only
    metrics_port: int | None = 9451  # the orchestrator's Prometheus /metrics (+ i); None = off
    replicas: int = 1  # orchestrator replicas (a role's: its RoleConfig's; a target's, a GPU each where there are)
    routing: str = ROUTINGS[0]  # how each orchestrator places new requests on the pools (router.py)
    migration_limit: int = MIGRATION_LIMIT  # moves per request off a failed target replica (migration.py)
    workers: int = 2  # generation actors per replica
    draft_address: str | None = None  # what the orchestrator dials for the draft (default: its node:port)
    target_address: str | None = None  # e.g. a proxy or a Kubernetes Service in front of the target
    health_period_s: float = 5.0  # between health checks of every server
    restart_after_s: float = 60.0  # silence before a server is restarted: longer than a restart takes to bind


@dataclass
class Deployed:
    name: str  # draft, target, orchestrator-0, ...
    actor: ray.actor.ActorHandle
    address: str = ""  # node ip:port where it serves
    pid: int = 0
    silent_since: float | None = None  # monotonic time of the first unanswered health check in a row


def placement(role: str, resources: dict, gpus: float = 0) -> dict:
    """Ray actor options that put `role` on the right kind of node of this cluster.

    A node offers a role as a custom resource of that name (`ray start --resources='{"draft": 1}'`);
    asking for a sliver of it lets replicas share a node. `gpus`: num_gpus the actor asks for (the
    target's --target-gpus); a target placed by GPU, for want of a `target` resource, asks for 1 at least.
    """
    if role in resources:
        options = {"resources": {role: 0.01}, "num_cpus": 0}
        return {**options, "num_gpus": gpus} if gpus else options
    if role == "target" and resources.get("GPU", 0) >= 1:
        return {"num_gpus": max(gpus, 1), "num_cpus": 0}
    return {"num_gpus": gpus, "num_cpus": 0} if gpus else {"num_cpus": 0}


@ray.remote
class ModelServiceActor:
    """A draft or target gRPC server (health, reflection, metrics) in this actor's event loop."""

    def __init__(
        self,
        role: str,
        settings: RoleConfig,
        dtype: str | None,
        limits: Limits,
        port: int,
        metrics_port: int | None,
        security: ServerSecurity = ServerSecurity(),
        otlp_endpoint: str | None = None,
        exactness: str = "bitwise",
    ):
        """`settings`: the role's (its model, engine settings and threads); `port` and `metrics_port`:
        this replica's."""
        from specd.proto import tracing

        tracing.setup(otlp_endpoint, f"specd-{role}")  # before the server exists: its calls get spans
        self.port = port
        self.security = security
        # Ray runs an async actor's constructor on its event loop, so a restart serves again.
        self.serving = asyncio.get_running_loop().create_task(
            self._serve(role, settings, dtype, limits, metrics_port, exactness)
        )

    async def _serve(self, role, settings, dtype, limits, metrics_port, exactness) -> None:
        from specd.deploy.services import model_server
        from specd.proto.metrics import start_exporter

        # `device` (and with it the engine `auto` picks) resolves here, in the actor: with num_gpus,
        # Ray has set CUDA_VISIBLE_DEVICES to the GPU(s) it assigned, so auto and cuda mean cuda:0 of those
        self.server = model_server(role, settings, dtype, limits, exactness)
        if not await self.server.start(f"0.0.0.0:{self.port}", self.security):
            raise OSError(f"the {role} service could not bind port {self.port}")
        if metrics_port is not None:
            start_exporter(self.server.metrics.registry, "0.0.0.0", metrics_port)
        await self.server.load()

    async def where(self) -> tuple[str, int]:
        """(node ip:port, pid) once the port is bound; raises what stopped the server."""
        while not (getattr(self, "server", None) and self.server.port):
            if self.serving.done():
                self.serving.result()
            await asyncio.sleep(0.05)
        return f"{ray.util.get_node_ip_address()}:{self.port}", os.getpid()

    async def failure(self) -> str | None:
        """Why the server stopped, if it did (e.g. the model would not load, or no GPU on this node)."""
        if self.serving.done() and self.serving.exception():
            return repr(self.serving.exception())
        return None


@ray.remote
class OrchestratorActor:
    """One orchestrator replica: SpecDecode gRPC, the HTTP API and metrics, with its own Ray workers."""

    def __init__(
        self,
        draft_address: str | None,
        target_address: str,
        port: int,
        http_port: int | None,
        metrics_port: int | None,
        options: dict,
    ):
        """`options`: OrchestratorServer's keyword arguments (workers, security, policy, limits, ...)."""
        from specd.orchestrator.server import OrchestratorServer
        from specd.proto import tracing

        tracing.setup(options.get("otlp_endpoint"), "specd-orchestrator")  # its Ray workers set up their own
        self.port = port
        self.server = OrchestratorServer(draft_address, target_address, **options)
        self.serving = asyncio.get_running_loop().create_task(self._serve(http_port, metrics_port))

    async def _serve(self, http_port, metrics_port) -> None:
        from specd.proto.metrics import start_exporter

        await self.server.start(f"0.0.0.0:{self.port}")
        if http_port is not None:
            await self.server.start_http("0.0.0.0", http_port)
        if metrics_port is not None:
            start_exporter(self.server.metrics.registry, "0.0.0.0", metrics_port)

    async def where(self) -> tuple[str, int]:
        await self.serving
        return f"{ray.util.get_node_ip_address()}:{self.port}", os.getpid()


class ClusterStack:
    def __init__(self, config: ClusterConfig, say=lambda message: print(message, file=sys.stderr, flush=True)):
        self.config = config
        self.say = say
        self.deployed: list[Deployed] = []

    @property
    def address(self) -> str:
        """The first orchestrator replica's gRPC address."""
        return next(d.address for d in self.deployed if d.name.startswith("orchestrator"))

    async def start(self) -> "ClusterStack":
        config = self.config
        if not ray.is_initialized():
            _token_auth_when_token_available()
            ray.init(address=config.ray_address, logging_level="WARNING")
        resources = ray.cluster_resources()
        self.say(f"Ray cluster: {len(ray.nodes())} nodes, resources {_summary(resources)}")
        drafts = config.draft.replicas if config.drafter not in LOOKUP_ONLY else 0  # lookups never call a draft
        started = await asyncio.gather(
            *(self._start_service("draft", resources, i) for i in range(drafts)),
            *(self._start_service("target", resources, i) for i in range(config.target.replicas)),
        )
        pools = {"draft": started[:drafts], "target": started[drafts:]}  # each orchestrator routes over them
        draft_address = (config.draft_address or _pool(pools["draft"])) if drafts else None
        for i in range(config.replicas):
            await self._start_orchestrator(i, draft_address, config.target_address or _pool(pools["target"]), resources)
        return self

    async def _start_service(self, role: str, resources: dict, replica: int = 0) -> Deployed:
        """Replica `replica` of `role`: an actor of its own, on the role's ports + REPLICA_PORT_STEP × replica
        (two replicas Ray puts on one node must not share a port)."""
        config = self.config
        settings = getattr(config, role)
        settings = replace(settings, threads=settings.threads or config.threads)
        options = placement(role, resources, config.target_gpus if role == "target" else 0)
        name = f"{role}-{replica}" if replica else role
        actor = ModelServiceActor.options(name=f"specd-{name}", max_restarts=-1, **options).remote(
            role,
            settings,
            config.dtype,
            config.limits,
            settings.port + REPLICA_PORT_STEP * replica,
            _plus(settings.metrics_port, REPLICA_PORT_STEP * replica),
            config.security,
            config.otlp_endpoint,
            exactness=config.exactness,
        )
        deployed = await self._locate(Deployed(name, actor))
        gpu_note = f", {options['num_gpus']:g} GPU from Ray" if options.get("num_gpus") else ""
        resolved = settings.service_options()
        where = f"pid {deployed.pid}, --device {resolved['device']}{gpu_note}, --engine {resolved['engine']}"
        self.say(f"{name}: loading {settings.model} on {deployed.address} ({where})")
        await self._until_serving(deployed, timeout_s=900)
        return deployed

    async def _start_orchestrator(
        self, index: int, draft_address: str | None, target_address: str, resources: dict
    ) -> None:
        config = self.config
        actor = OrchestratorActor.options(
            name=f"specd-orchestrator-{index}", max_restarts=-1, **placement("orchestrator", resources)
        ).remote(
            draft_address,
            target_address,
            config.port + index,
            _plus(config.http_port, index),
            _plus(config.metrics_port, index),
            orchestrator_options(config),
        )
        deployed = await self._locate(Deployed(f"orchestrator-{index}", actor))
        await self._until_serving(deployed, timeout_s=300)

    async def _locate(self, deployed: Deployed) -> Deployed:
        deployed.address, deployed.pid = await deployed.actor.where.remote()
        self.deployed.append(deployed)
        return deployed

    async def _until_serving(self, deployed: Deployed, timeout_s: float) -> None:
        waiting = asyncio.create_task(wait_until_serving(deployed.address, timeout_s, self.config.service_security))
        while not waiting.done():
            if deployed.name.startswith(("draft", "target")) and (why := await deployed.actor.failure.remote()):
                waiting.cancel()
                raise RuntimeError(f"the {deployed.name} service failed to start: {why}")
            await asyncio.wait({waiting}, timeout=1.0)
        await waiting

    async def watch(self) -> None:
        """Health-check every server forever; an actor that stops answering is killed for Ray to restart."""
        while True:
            await asyncio.sleep(self.config.health_period_s)
            await asyncio.gather(*(self._check(deployed) for deployed in self.deployed))

    async def _check(self, deployed: Deployed) -> None:
        now = time.monotonic()
        if await _answers_health(deployed.address, self.config.health_period_s, self.config.service_security):
            deployed.silent_since = None
        elif deployed.silent_since is None:
            deployed.silent_since = now
        elif now - deployed.silent_since >= self.config.restart_after_s:
            self.say(
                f"{deployed.name} on {deployed.address} has not answered health checks for "
                f"{now - deployed.silent_since:.0f} s: restarting it"
            )
            ray.kill(deployed.actor, no_restart=False)
            deployed.silent_since = None

    def stop(self) -> None:
        for deployed in reversed(self.deployed):
            ray.kill(deployed.actor)
        self.deployed.clear()
        if ray.is_initialized():
            ray.shutdown()


def orchestrator_options(config: ClusterConfig) -> dict:
    """OrchestratorServer's keyword arguments for a replica: what `specd serve orchestrator` takes as flags."""
    return dict(
        workers=config.workers,
        default_draft_tokens=None,  # auto
        max_draft_tokens=config.max_draft_tokens,
        drafter=config.drafter,
        policy=config.policy,
        security=config.security,
        service_security=config.service_security,
        max_concurrent_requests=config.max_concurrent_requests,
        max_prompt_tokens=config.max_prompt_tokens,
        otlp_endpoint=config.otlp_endpoint,
        routing=config.routing,
        migration_limit=config.migration_limit,
    )


def _pool(deployed: list[Deployed]) -> str:
    """What an orchestrator dials for a role's replicas: their addresses, comma-separated."""
    return ",".join(replica.address for replica in deployed)


def _plus(port: int | None, index: int) -> int | None:
    return None if port is None else port + index


async def _answers_health(address: str, timeout_s: float, security: ClientSecurity = ClientSecurity()) -> bool:
    """Whether grpc.health.v1 answers at all (NOT_SERVING while a model loads is an answer); health needs
    no token, but over TLS it needs the CA."""
    async with security.channel(address) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return True
        except grpc.aio.AioRpcError:
            return False


def _token_auth_when_token_available() -> None:
    """`ray start --head` turns token auth on; ray.init follows by itself only for address="auto".

    Ray's own rule for "auto": token mode when a token exists (RAY_AUTH_TOKEN, ~/.ray/auth_token).
    """
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _summary(resources: dict) -> str:
    return ", ".join(
        f"{name} {value:g}"
        for name, value in sorted(resources.items())
        if not name.startswith(("node:", "memory", "object_store"))
    )
