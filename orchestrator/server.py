"""specd.v1.SpecDecode: validate and tokenize a request, hand it to a Ray worker, stream it back."""

import asyncio
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.proto.auth import ClientSecurity, ServerSecurity
from specd.proto.metrics import start_exporter
from specd.orchestrator.adaptive import DEFAULT_MAX_DRAFT_TOKENS
from specd.orchestrator.faults import FaultPolicy
from specd.orchestrator.generation import Delta, Finished, GenerationRequest
from specd.orchestrator.metrics import OrchestratorMetrics
from specd.orchestrator.remote import ServicePair, connect_pair
from specd.orchestrator.worker import Failed, WorkerPool
from specd.v1 import specdecode_pb2, specdecode_pb2_grpc

SERVICE_NAME = "specd.v1.SpecDecode"


class BadRequest(Exception):
    """INVALID_ARGUMENT, with a message the client can act on."""


class SpecDecodeServicer(specdecode_pb2_grpc.SpecDecodeServicer):
    def __init__(self, pair: ServicePair, pool: WorkerPool, default_draft_tokens: int | None = None,
                 metrics: OrchestratorMetrics | None = None, max_prompt_tokens: int | None = None,
                 max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS):
        self.max_prompt_tokens = max_prompt_tokens  # longest prompt accepted; None = what a session holds
        self.pair = pair
        self.pool = pool
        self.default_draft_tokens = default_draft_tokens  # None: adaptive (chosen every step)
        self.max_draft_tokens = min(max_draft_tokens, *self.services_max_k())
        self.metrics = metrics or OrchestratorMetrics()

    async def Generate(self, request, context):
        try:
            generation_request = self.prepare(request, context.time_remaining())
        except BadRequest as error:
            self.metrics.rejected("grpc")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        async for event in self.generate(generation_request, "grpc"):
            if isinstance(event, Failed):
                await context.abort(grpc.StatusCode[event.code], event.message)
            yield to_proto(event)

    async def Info(self, request, context):
        return specdecode_pb2.OrchestratorInfo(
            draft=self.pair.draft_info, target=self.pair.target_info,
            default_draft_tokens=self.default_draft_tokens or 0, workers=len(self.pool.actors),
            adaptive_draft_tokens=self.default_draft_tokens is None, max_draft_tokens=self.max_draft_tokens,
        )

    def services_max_k(self) -> tuple[int, int]:
        return self.pair.draft_info.max_draft_tokens, self.pair.target_info.max_draft_tokens

    def generate(self, request: GenerationRequest, api: str):
        """Run a prepared request on the pool: Delta events, then Finished or Failed (every API's path)."""
        return self.metrics.track(api, self.pool.generate(request))

    def prepare(self, request: specdecode_pb2.GenerateRequest, time_remaining: float | None) -> GenerationRequest:
        """Check the request against docs/architecture.md §5 and the served pair; tokenize the prompt."""
        prompt_ids = list(request.prompt_token_ids)
        if request.prompt:
            prompt_ids = self.pair.tokenizer.encode(request.prompt, add_special_tokens=False).ids
        if not prompt_ids:
            raise BadRequest("the prompt is empty: send `prompt` text or `prompt_token_ids`")
        target = self.pair.target_info
        if max(prompt_ids) >= target.vocab_size:
            raise BadRequest(f"prompt token id {max(prompt_ids)} is outside the vocabulary of {target.vocab_size}")
        if self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens:
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens, this server accepts at most "
                             f"{self.max_prompt_tokens} (--max-prompt-tokens); shorten it")
        if request.max_new_tokens < 1:
            raise BadRequest("max_new_tokens must be at least 1")
        room = min(target.max_session_tokens, self.pair.draft_info.max_session_tokens)
        if len(prompt_ids) + request.max_new_tokens > room:
            raise BadRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the "
                f"{room} tokens a session may hold; shorten the prompt or ask for fewer tokens"
            )
        sampling = request.sampling
        if not sampling.temperature >= 0 or sampling.temperature == float("inf"):
            raise BadRequest(f"temperature must be a finite number >= 0, got {sampling.temperature}")
        if not 0 <= sampling.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1] (0 means 1), got {sampling.top_p}")
        k = request.draft_tokens if request.HasField("draft_tokens") else self.default_draft_tokens
        max_k = min(self.services_max_k())
        if k is not None and k > max_k:
            raise BadRequest(f"draft_tokens K={k} is above the largest the services accept ({max_k}); 0 turns speculation off")
        return GenerationRequest(
            prompt_ids=prompt_ids, max_new_tokens=request.max_new_tokens,
            temperature=sampling.temperature, top_p=sampling.top_p or 1.0, top_k=sampling.top_k,
            seed=sampling.seed, stop=list(request.stop), draft_tokens=k, max_draft_tokens=self.max_draft_tokens,
            ignore_eos=request.ignore_eos,
            deadline=None if time_remaining is None else time.time() + time_remaining,
        )


def to_proto(event: Delta | Finished) -> specdecode_pb2.GenerateResponse:
    if isinstance(event, Delta):
        return specdecode_pb2.GenerateResponse(delta=specdecode_pb2.Delta(text=event.text, token_ids=event.token_ids))
    stats = event.stats
    return specdecode_pb2.GenerateResponse(final=specdecode_pb2.Final(
        finish_reason=event.reason,
        usage=specdecode_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
        stats=specdecode_pb2.SpeculationStats(
            draft_tokens=stats.draft_tokens, adaptive=stats.adaptive, draft_lengths=stats.draft_lengths,
            drafting_steps=stats.drafting_steps, network_seconds=stats.network_seconds,
            step_draft_seconds=[step[0] for step in stats.step_seconds],
            step_verify_seconds=[step[1] for step in stats.step_seconds],
            steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
            acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
            accepted_per_position=stats.accepted_per_position, draft_seconds=stats.draft_seconds,
            verify_seconds=stats.verify_seconds, other_seconds=stats.other_seconds,
            tokens_per_s=stats.tokens_per_s, resyncs=stats.resyncs,
            time_to_first_token_s=stats.time_to_first_token_s,
        ),
    ))


class OrchestratorServer:
    """The SpecDecode server: connect to the pair, start the Ray workers, serve."""

    def __init__(self, draft_address: str, target_address: str, workers: int = 2,
                 default_draft_tokens: int | None = None, policy: FaultPolicy = FaultPolicy(),
                 security: ServerSecurity = ServerSecurity(), service_security: ClientSecurity = ClientSecurity(),
                 max_concurrent_requests: int | None = None, max_prompt_tokens: int | None = None,
                 max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS):
        self.policy = policy  # per-call caps, target retries, draft back-off (faults.py)
        self.security = security  # this server's token and TLS
        self.service_security = service_security  # the token and CA it uses towards the services
        self.limits = (max_concurrent_requests, max_prompt_tokens)  # None = unlimited
        self.addresses = (draft_address, target_address)
        self.workers = workers
        self.default_draft_tokens = default_draft_tokens  # None: adaptive
        self.max_draft_tokens = max_draft_tokens
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.pool: WorkerPool | None = None
        self.port = 0
        self.metrics = OrchestratorMetrics()
        self.servicer: SpecDecodeServicer | None = None
        self.http = None  # the OpenAI-compatible HTTP API, when started (openai_api.HttpApi)

    async def start(self, address: str = "127.0.0.1:0") -> int:
        pair = await connect_pair(*self.addresses, security=self.service_security)
        self.pool = WorkerPool(*self.addresses, workers=self.workers, policy=self.policy,
                               security=self.service_security, max_requests=self.limits[0], pair=pair)
        await self.pool.ready()
        self.server = grpc.aio.server(interceptors=self.security.interceptors())
        self.servicer = SpecDecodeServicer(pair, self.pool, self.default_draft_tokens, self.metrics,
                                           max_prompt_tokens=self.limits[1], max_draft_tokens=self.max_draft_tokens)
        specdecode_pb2_grpc.add_SpecDecodeServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port = self.security.bind(self.server, address)
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def start_http(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """After start(): the OpenAI-compatible HTTP API on the same servicer; returns its port."""
        from specd.orchestrator.openai_api import HttpApi

        security = self.security
        self.http = HttpApi(self.servicer, token=security.token,
                            tls=(security.tls_cert, security.tls_key) if security.tls_cert else None)
        return await self.http.start(host, port)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self.http:
            await self.http.stop()
        if self.server:
            await self.server.stop(grace)
        if self.pool:
            self.pool.shutdown()


async def serve_until_signal(server: OrchestratorServer, address: str, http_port: int | None = None,
                             metrics_port: int | None = None) -> None:
    """gRPC on `address`; the HTTP API and the metrics exporter on the same host (None = not started)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
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
    await server.stop()
