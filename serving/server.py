"""gRPC plumbing the draft and target services share.

Thin servicer, thick engine: the servicers translate messages; this module runs engine calls
on the one model thread (batching concurrent Verify or Propose calls, see model/scheduler.py),
turns engine errors into status codes (docs/architecture.md §5), and hosts health, reflection, idle
eviction and graceful shutdown.
"""

import asyncio
import logging
import math
import signal
import threading
import time
from typing import Callable

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.proto.auth import ServerSecurity
from specd.proto.contract import HELD_FINGERPRINT_KEY, HELD_TOKENS_KEY
from specd.proto.metrics import start_exporter
from specd.serving.metrics import ServiceMetrics
from specd.model.engine import Engine
from specd.model.errors import CapacityExceeded, CursorMismatch, EngineError, InvalidRequest, SessionNotFound
from specd.model.sampling import Sampling
from specd.model.scheduler import Abandoned, Bounds, Job, Scheduler
from specd.model.sessions import Cursor
from specd.v1 import common_pb2, draft_pb2

log = logging.getLogger("specd.serving.server")

STATUS_OF = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    CursorMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # q rows of a long sampled draft can pass the 4 MiB default


class ModelThread:
    """The one thread that runs engine calls, behind a scheduler that batches concurrent calls."""

    def __init__(self):
        self.scheduler = Scheduler()
        self.engine: Engine | None = None
        self.draining = False

    async def load(self, load_engine: Callable[[], Engine]) -> Engine:
        self.engine = await asyncio.wrap_future(self.scheduler.submit(Job(lambda _: [load_engine()])))
        limits = self.engine.limits
        self.scheduler.bounds = Bounds(limits.max_batch_size, limits.max_batch_tokens, limits.batch_wait_ms / 1000)
        return self.engine

    async def run(self, method: Callable, *args):
        """Run method(engine, *args) with no RPC attached (housekeeping)."""
        return await asyncio.wrap_future(self.scheduler.submit(Job(lambda _: [method(self.engine, *args)])))

    async def info(self, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        """Answered on the event loop: Info must not wait behind a Verify."""
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; watch grpc.health.v1")
        return model_info(self.engine, self.scheduler)

    async def call(self, context: grpc.aio.ServicerContext, method: Callable, *args):
        """Run method(engine, *args) alone for an RPC; errors leave as status codes."""
        return await self._submit(context, Job(lambda _: [method(self.engine, *args)]))

    async def batch(self, context: grpc.aio.ServicerContext, batch_method: Callable, call):
        """Run batch_method(engine, [call, ...]) for an RPC, sharing the pass with waiting calls."""
        run = lambda calls: batch_method(self.engine, calls)  # noqa: E731
        job = Job(run, call, kind=batch_method, cost=call.new_tokens, session_id=call.cursor.session_id)
        return await self._submit(context, job)

    async def _submit(self, context: grpc.aio.ServicerContext, job: Job):
        if self.engine is None or self.draining:
            state = "still loading" if self.engine is None else "shutting down"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the model is {state}; watch grpc.health.v1")
        job.abandoned = _abandoned_check(context)
        try:
            return await asyncio.wrap_future(self.scheduler.submit(job))
        except EngineError as error:
            await context.abort(STATUS_OF[type(error)], str(error), _held_metadata(error))
        except Abandoned as abandoned:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(abandoned))

    def shutdown(self) -> None:
        self.scheduler.close()


def _abandoned_check(context: grpc.aio.ServicerContext) -> Callable[[], str | None]:
    """Why a queued call should be skipped when the model thread reaches it, if it should."""
    finished = threading.Event()
    context.add_done_callback(lambda _: finished.set())
    remaining = context.time_remaining()
    deadline = math.inf if remaining is None else time.monotonic() + remaining

    def abandoned() -> str | None:
        if finished.is_set():
            return "the call ended before the model thread reached it"
        if time.monotonic() > deadline:
            return "the deadline passed while the call waited for the model thread"
        return None

    return abandoned


async def parsed(context: grpc.aio.ServicerContext, parse: Callable, *args):
    """parse(*args) on the event loop (message checks that need no model); refusals leave as status codes."""
    try:
        return parse(*args)
    except EngineError as error:
        await context.abort(STATUS_OF[type(error)], str(error))


def _held_metadata(error: EngineError) -> tuple:
    if isinstance(error, CursorMismatch):
        return ((HELD_TOKENS_KEY, str(error.held_tokens)), (HELD_FINGERPRINT_KEY, str(error.held_fingerprint)))
    return ()


# -- message translation shared by both servicers -------------------------------------------

def cursor_from_proto(cursor: common_pb2.SessionCursor) -> Cursor:
    return Cursor(cursor.session_id, cursor.start, cursor.fingerprint, list(cursor.tokens))


def sampling_from_proto(sampling: common_pb2.SamplingParams) -> Sampling:
    return Sampling(sampling.temperature, sampling.top_p or 1.0, sampling.top_k, sampling.seed)


def q_row_to_proto(token_ids: torch.Tensor, probs: torch.Tensor) -> draft_pb2.SparseDistribution:
    return draft_pb2.SparseDistribution(
        token_ids=token_ids.tolist(), probs=probs.numpy().astype("<f4").tobytes()
    )


def q_row_from_proto(row: draft_pb2.SparseDistribution) -> tuple[torch.Tensor, torch.Tensor]:
    if len(row.probs) % 4:
        raise InvalidRequest("q probs must be little-endian float32 (a multiple of 4 bytes)")
    probs = torch.from_numpy(np.frombuffer(row.probs, dtype="<f4").copy())
    return torch.tensor(list(row.token_ids), dtype=torch.long), probs


def model_info(engine: Engine, scheduler: Scheduler) -> common_pb2.ModelInfo:
    described, limits = engine.description, engine.limits
    return common_pb2.ModelInfo(
        model=described.model,
        role=described.role,
        vocab_size=described.vocab_size,
        tokenizer_fingerprint=described.tokenizer_fingerprint,
        dtype=described.dtype,
        max_session_tokens=limits.max_session_tokens,
        max_sessions=limits.max_sessions,
        max_cached_tokens=limits.max_cached_tokens,
        max_draft_tokens=limits.max_draft_tokens,
        eos_token_ids=described.eos_token_ids,
        live_sessions=len(engine.store.sessions),
        cached_tokens=engine.store.cached_tokens,
        max_batch_size=limits.max_batch_size,
        max_batch_tokens=limits.max_batch_tokens,
        batch_sizes=dict(scheduler.batch_sizes),
        queued_calls=scheduler.queue_depth,
        quantization=described.quantization,
    )


# -- hosting ---------------------------------------------------------------------------------

class ModelServer:
    """One model behind a grpc.aio server: bind, report NOT_SERVING, load, report SERVING."""

    def __init__(self, service_name: str, add_servicer: Callable, servicer_class: type, load_engine: Callable):
        self.service_name = service_name
        self.add_servicer = add_servicer
        self.servicer_class = servicer_class
        self.load_engine = load_engine
        self.thread = ModelThread()
        self.metrics = ServiceMetrics(self.thread)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._evictor: asyncio.Task | None = None

    async def start(self, address: str = "127.0.0.1:0", security: ServerSecurity = ServerSecurity()) -> int:
        """Bind and start answering (health says NOT_SERVING until load() ends); returns the port."""
        self.server = grpc.aio.server(
            interceptors=[*security.interceptors(), self.metrics.interceptor],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        self.add_servicer(self.servicer_class(self.thread), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (self.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.port = security.bind(self.server, address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        await self.server.start()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        return self.port

    async def load(self) -> Engine:
        engine = await self.thread.load(self.load_engine)
        self._evictor = asyncio.create_task(self._evict_forever(engine.limits.idle_timeout_s))
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return engine

    async def stop(self, grace: float = 5.0) -> None:
        """Drain: refuse new calls, let running ones finish within `grace`, free the model thread."""
        self.thread.draining = True
        await self.health.enter_graceful_shutdown()
        if self._evictor:
            self._evictor.cancel()
        if self.server:
            await self.server.stop(grace)
        await asyncio.get_running_loop().run_in_executor(None, self.thread.shutdown)

    async def _set_health(self, status) -> None:
        for name in ("", self.service_name):
            await self.health.set(name, status)

    async def _evict_forever(self, idle_timeout_s: float) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(idle_timeout_s / 4, 10.0)))
            evicted = await self.thread.run(Engine.evict_idle)
            if evicted:
                log.info("evicted %d idle sessions", len(evicted))


async def serve_until_signal(model_server: ModelServer, address: str, metrics_host: str = "127.0.0.1",
                             metrics_port: int | None = None, security: ServerSecurity = ServerSecurity()) -> None:
    """The `specd serve` main: start, load, serve until SIGINT/SIGTERM, then drain."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    port = await model_server.start(address, security)
    if metrics_port is not None:
        exporter = start_exporter(model_server.metrics.registry, metrics_host, metrics_port)
        print(f"{model_server.service_name} metrics on http://{metrics_host}:{exporter.server_port}/metrics", flush=True)
    print(f"{model_server.service_name} listening on port {port}; loading the model", flush=True)
    loading = asyncio.create_task(model_server.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        loading.result()
        print(f"{model_server.service_name} ready on port {port}", flush=True)
        await stopping
    await model_server.stop()
