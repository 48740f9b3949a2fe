"""Ray actors that run generation loops; a pool that spreads requests over them.

Each GenerationWorker is an async Ray actor holding its own gRPC channels to the draft and the
target (the target alone where the orchestrator runs without a draft, remote.py); it runs many
requests concurrently (one Generation each) and streams events back through a Ray streaming
generator. Ray places and restarts the actors; the pool only picks the least busy one, refuses
requests past its limit (RESOURCE_EXHAUSTED), and ends a request whose actor died with UNAVAILABLE
(the actor restarts and serves the next requests).

The target may be a pool of replicas (`target_address` "host:port,host:port,..."): the pool routes
each new request to one of them by load and by the prefixes each was sent (router.py) and the
request stays there; every worker holds channels to every replica, and measures each one's costs
apart (its own load B, its own pass times).
"""

import asyncio
import contextlib
import dataclasses
import itertools
import uuid

import grpc
import ray
from ray.exceptions import RayActorError

from specd.orchestrator.ahead import share_cores
from specd.orchestrator.costs import ServiceCosts
from specd.orchestrator.faults import DraftGate, FaultPolicy, ServiceFailed
from specd.orchestrator.generation import Generation
from specd.orchestrator.remote import ServicePair, connect_pair
from specd.orchestrator.request import Failed, GenerationRequest
from specd.orchestrator.router import Router
from specd.orchestrator.suffix import RecentOutputs
from specd.proto import tracing
from specd.proto.auth import ClientSecurity
from specd.v1 import common_pb2


class GenerationWorker:
    def __init__(
        self,
        draft_address: str | None,
        target_address: str,
        policy: FaultPolicy = FaultPolicy(),
        security: ClientSecurity = ClientSecurity(),
        otlp_endpoint: str | None = None,
    ):
        tracing.setup(otlp_endpoint, "specd-orchestrator")  # this actor is a process of its own: it traces itself
        self.draft_address = draft_address
        self.targets = target_replicas(target_address)
        self.policy = policy
        self.security = security  # the orchestrator's own token and CA, towards the services
        self.draft_gate = DraftGate(policy)  # one per worker: a dead draft is noticed once, not per request
        # one per worker and target replica: what calls cost now, for choosing K (costs.py)
        self.costs = {target: ServiceCosts() for target in self.targets}
        self.recent_outputs = RecentOutputs()  # one per worker: its latest outputs, for the suffix drafter
        self.pairs: dict[str, ServicePair] = {}  # per target replica: the draft and that target
        self.connecting = asyncio.Lock()

    async def ready(self) -> bool:
        for target in self.targets:
            await self._connect(target)
        return True

    async def generate(self, request: GenerationRequest, trace_carrier: dict[str, str] | None = None):
        """The request's events; `trace_carrier`: the caller's trace context (tracing.carrier)."""
        target = request.target or self.targets[0]
        pair = await self._connect(target)
        generation = Generation(
            request,
            pair.draft_stub,
            pair.target_stub,
            pair.tokenizer,
            set(pair.target_info.eos_token_ids),
            self.policy,
            self.draft_gate,
            self.costs[target],
            trace_parent=tracing.parent(trace_carrier),
            recent=self.recent_outputs,
        )
        try:
            async for event in generation.run():
                yield event
        except ServiceFailed as failure:
            yield Failed(failure.code.name, str(failure))
        except grpc.aio.AioRpcError as error:
            yield Failed(error.code().name, f"{error.details()} (from a model service)")

    async def _connect(self, target: str) -> ServicePair:
        async with self.connecting:
            if (pair := self.pairs.get(target)) is None:
                pair = self.pairs[target] = await connect_pair(self.draft_address, target, security=self.security)
                if pair.has_draft:
                    self.costs[target].shared_cores = share_cores(
                        self.draft_address, target, pair.draft_info, pair.target_info
                    )
            return pair


def target_replicas(target_address: str) -> list[str]:
    """The target replicas of a --target: one address, or several comma-separated (a pool)."""
    replicas = [address.strip() for address in target_address.split(",") if address.strip()]
    if not replicas:
        raise ValueError("--target needs a HOST:PORT (or several, comma-separated)")
    return replicas


RemoteWorker = ray.remote(GenerationWorker)


RESTART_WAIT_S = 30.0  # how long a request that no actor could start waits for one to restart


class WorkerPool:
    """N Ray actors; each request goes to the one with the fewest requests in flight."""

    def __init__(
        self,
        draft_address: str | None,
        target_address: str,
        workers: int = 2,
        concurrency: int = 64,
        policy: FaultPolicy = FaultPolicy(),
        security: ClientSecurity = ClientSecurity(),
        max_requests: int | None = None,
        pair: ServicePair | None = None,
        otlp_endpoint: str | None = None,
    ):
        self.actors = [
            RemoteWorker.options(max_concurrency=concurrency, max_restarts=-1, num_cpus=0).remote(
                draft_address, target_address, policy, security, otlp_endpoint
            )
            for _ in range(workers)
        ]
        self.max_requests = max_requests  # requests in flight over all actors; None = no limit
        self.pair = pair  # stubs to release the sessions of a request whose actor died
        self.in_flight = [0] * workers
        self._turns = itertools.count()  # rotates which actor wins a tie
        self.router = Router(target_replicas(target_address))  # which target replica serves a new request

    async def ready(self) -> None:
        await asyncio.gather(*(actor.ready.remote() for actor in self.actors))

    async def generate(self, request: GenerationRequest):
        if self.max_requests is not None and sum(self.in_flight) >= self.max_requests:
            yield Failed(
                "RESOURCE_EXHAUSTED",
                (
                    f"the orchestrator is already running {sum(self.in_flight)} requests, its limit "
                    f"(--max-concurrent-requests {self.max_requests}); retry later or use another replica"
                ),
            )
            return
        route = self.router.route(request.prompt_ids, request.cache_salt)
        request = dataclasses.replace(request, session_id=request.session_id or uuid.uuid4().hex, target=route.replica)
        try:
            async with contextlib.aclosing(self._on_a_worker(request)) as events:
                async for event in events:
                    yield event
        finally:
            self.router.done(route.replica)

    async def _on_a_worker(self, request: GenerationRequest):
        """The request's events from the least busy worker, another if that one dies before it starts."""
        tried: set[int] = set()
        waited = False
        while True:
            index = self._least_busy(tried)
            tried.add(index)
            started = False
            try:
                # aclosing: a client cancel closes this generator, and must close the actor's stream
                # now (ray.cancel in _stream), not whenever the garbage collector gets to it.
                async with contextlib.aclosing(self._stream(index, request)) as events:
                    async for event in events:
                        started = True
                        yield event
                return
            except RayActorError as error:
                await self._release(request.session_id)
                if not started and len(tried) == len(self.actors) and not waited:
                    # Nothing sent and every actor down (one worker, or all restarting): wait for the
                    # first to come back, once, rather than fail a request that can still be served.
                    waited = True
                    if (back := await self._first_back(RESTART_WAIT_S)) is not None:
                        tried.discard(back)
                        continue
                if started or len(tried) == len(self.actors):
                    yield Failed(
                        "UNAVAILABLE",
                        (
                            f"the orchestrator worker running this request died ({type(error).__name__}); it restarts "
                            f"by itself: retry the request"
                        ),
                    )
                    return
                # Nothing was sent yet (the actor is still restarting): another actor serves it.

    async def _first_back(self, timeout_s: float) -> int | None:
        """The index of the first actor that answers `ready` within timeout_s, else None."""
        pending = [asyncio.ensure_future(self._ready(index)) for index in range(len(self.actors))]
        try:
            for done in asyncio.as_completed(pending, timeout=timeout_s):
                return await done
        except TimeoutError:
            return None
        finally:
            for future in pending:
                future.cancel()

    async def _ready(self, index: int) -> int:
        """Ask until the actor answers (a restarting actor refuses calls for a while)."""
        while True:
            try:
                await self.actors[index].ready.remote()
                return index
            except RayActorError:
                await asyncio.sleep(0.25)

    def _least_busy(self, skip: set[int]) -> int:
        count, first = len(self.actors), next(self._turns)
        candidates = [(first + i) % count for i in range(count) if (first + i) % count not in skip]
        return min(candidates, key=lambda i: self.in_flight[i])

    async def _stream(self, index: int, request: GenerationRequest):
        self.in_flight[index] += 1
        # The trace context of the call being served (its gRPC span), for the worker's spans of the request.
        stream = self.actors[index].generate.options(num_returns="streaming").remote(request, tracing.carrier())
        try:
            async for ref in stream:
                yield await ref
        finally:
            self.in_flight[index] -= 1
            ray.cancel(stream)  # a no-op when it finished; on a client cancel it stops the loop

    async def _release(self, session_id: str) -> None:
        """Release a dead actor's sessions now rather than at idle eviction."""
        if self.pair:
            release = common_pb2.ReleaseRequest(session_id=session_id)
            await asyncio.gather(
                *(stub.Release(release, timeout=5.0) for stub in self.pair.stubs), return_exceptions=True
            )

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
