"""Hosting a model service: one grpc.aio server with the servicer, health, reflection, idle
eviction, metrics and graceful shutdown. The servicers in draft_service/ and target_service/
stay thin: they translate messages (serving/messages.py) and run the service's methods on the
model thread (serving/thread.py).
"""

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.model.service import ModelService
from specd.proto.auth import ServerSecurity
from specd.proto.host import DEFAULT_DRAIN_SECONDS, stop_on_signals
from specd.proto.limits import MAX_MESSAGE_BYTES
from specd.proto.metrics import start_exporter
from specd.serving.metrics import ServiceMetrics
from specd.serving.thread import ModelThread

log = logging.getLogger("specd.serving.server")

DRAIN_POLL_S = 0.05  # how often a drain looks whether the sessions held have ended
STOP_GRACE_S = 2.0  # after a drain, how long a pass still running gets to answer its calls


class ModelServer:
    """One model behind a grpc.aio server: bind, report NOT_SERVING, load, report SERVING."""

    def __init__(
        self, service_name: str, add_servicer: Callable, servicer_class: type, load_service: Callable[[], ModelService]
    ):
        self.service_name = service_name
        self.add_servicer = add_servicer
        self.servicer_class = servicer_class
        self.load_service = load_service
        self.thread = ModelThread()
        self.metrics = ServiceMetrics(self.thread)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._evictor: asyncio.Task | None = None
        self._hurry = False  # a second signal: end the drain now

    async def start(self, address: str = "127.0.0.1:0", security: ServerSecurity = ServerSecurity()) -> int:
        """Bind and start answering (health says NOT_SERVING until load() ends); returns the port."""
        self.server = grpc.aio.server(
            interceptors=[*security.interceptors(), self.metrics.interceptor],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
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

    async def load(self) -> ModelService:
        service = await self.thread.load(self.load_service)
        self._evictor = asyncio.create_task(self._evict_forever(service.limits.idle_timeout_s))
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return service

    async def stop(self, drain_seconds: float = DEFAULT_DRAIN_SECONDS) -> None:
        """Drain, then stop. Draining refuses new sessions (UNAVAILABLE, health NOT_SERVING) but keeps
        serving the sessions held, so that the orchestrator's requests in flight can finish; it waits
        up to `drain_seconds` (0: not at all) for them to end (Release, idle eviction), then the
        server stops, a running pass still answering, and the model thread is freed."""
        self.thread.draining = True
        await self.health.enter_graceful_shutdown()  # NOT_SERVING for "" and the service, and it stays so
        held, started = self._held(), time.monotonic()
        log.info(
            "draining: no new sessions, %d held, waiting up to %g s for them to end (--drain-seconds)",
            len(held),
            drain_seconds,
        )
        while self._held() and time.monotonic() < started + drain_seconds and not self._hurry:
            await asyncio.sleep(DRAIN_POLL_S)
        cut = len(held & self._held())
        log.info("drained in %.1f s, sessions: %d ended, %d cut", time.monotonic() - started, len(held) - cut, cut)
        if self._evictor:
            self._evictor.cancel()
        if self.server:
            await self.server.stop(STOP_GRACE_S if drain_seconds else 0)
        await asyncio.get_running_loop().run_in_executor(None, self.thread.shutdown)

    def hurry(self) -> None:
        """End a drain under way now (a second signal)."""
        self._hurry = True

    def _held(self) -> set[str]:
        """The ids of the sessions the service holds (none while it loads). The model thread changes
        the dict: copy() is one step under the GIL, where iterating it here could fail."""
        service = self.thread.service
        return set(service.store.sessions.copy()) if service else set()

    async def _set_health(self, status) -> None:
        for name in ("", self.service_name):
            await self.health.set(name, status)

    async def _evict_forever(self, idle_timeout_s: float) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(idle_timeout_s / 4, 10.0)))
            evicted = await self.thread.run(ModelService.evict_idle)
            if evicted:
                log.info("evicted %d idle sessions", len(evicted))


async def serve_until_signal(
    model_server: ModelServer,
    address: str,
    metrics_host: str = "127.0.0.1",
    metrics_port: int | None = None,
    security: ServerSecurity = ServerSecurity(),
    drain_seconds: float = DEFAULT_DRAIN_SECONDS,
) -> None:
    """The `specd serve` main: start, load, serve until SIGINT/SIGTERM, then drain for up to
    `drain_seconds` and stop; a second signal cuts the drain short."""
    stop = stop_on_signals(model_server.hurry)
    port = await model_server.start(address, security)
    if metrics_port is not None:
        exporter = start_exporter(model_server.metrics.registry, metrics_host, metrics_port)
        url = f"http://{metrics_host}:{exporter.server_port}/metrics"
        print(f"{model_server.service_name} metrics on {url}", flush=True)
    print(f"{model_server.service_name} listening on port {port}; loading the model", flush=True)
    loading = asyncio.create_task(model_server.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        loading.result()
        print(f"{model_server.service_name} ready on port {port}", flush=True)
        await stopping
    else:
        loading.cancel()  # a signal while the model loads: nothing is in flight
    await model_server.stop(drain_seconds)
