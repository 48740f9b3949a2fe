"""Ray actors that run generation loops; a pool that spreads requests over them.

Each GenerationWorker is an async Ray actor holding its own gRPC channels to the draft and the
target (the target alone where the orchestrator runs without a draft, remote.py); it runs many
requests concurrently (one Generation each) and streams events back through a Ray streaming
generator. Ray places and restarts the actors; the pool only picks the least busy one, refuses
requests past its limit (RESOURCE_EXHAUSTED), and carries a request whose actor died on to another
(or to the same one, restarted) from the tokens it streamed, as it moves one off a failed target
replica (migration.py); with `--migration-limit 0` the request ends UNAVAILABLE instead.

The target and the draft may each be a pool of replicas (`target_address` "host:port,host:port,...",
and so `draft_address`): the pool routes each new request to a target replica and, where its drafter
asks the draft, to a draft replica, each by load and by the prefixes each replica was sent (one
router per role, router.py); the request stays on them while they serve: one that fails moves it,
a target to another target replica (migration.py), a draft to another draft replica the pool named
(`spare_drafts`, Generation.move_draft). Every worker holds one channel to every
replica, a draft gate per draft replica, and measures each (draft, target) pair's costs apart (its
own load B, its own pass times).
"""

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import uuid

import grpc
import ray
from ray.exceptions import RayActorError

from specd.orchestrator.costs import ServiceCosts
from specd.orchestrator.faults import DraftGate, FaultPolicy, ServiceFailed
from specd.orchestrator.generation import DraftBinding, Generation
from specd.orchestrator.lookup import LOOKUP_ONLY
from specd.orchestrator.migration import MIGRATION_LIMIT, Progress, Rejoin
from specd.orchestrator.remote import Service, ServicePair, connect_service, pair_of, release_sessions, share_cores
from specd.orchestrator.request import Failed, Finished, GenerationRequest, Rebound
from specd.orchestrator.router import ROUTINGS, Router
from specd.orchestrator.suffix import RecentOutputs
from specd.proto import tracing
from specd.proto.auth import ClientSecurity

log = logging.getLogger("specd.orchestrator")


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
        self.drafts = replicas(draft_address) if draft_address else []
        self.targets = replicas(target_address)
        self.policy = policy
        self.security = security  # the orchestrator's own token and CA, towards the services
        # one per worker and draft replica (one added while serving too): a dead draft is noticed once,
        # not per request
        self.draft_gates: dict[str, DraftGate] = {}
        # one per worker and (draft, target) pair: what calls cost now, for choosing K (costs.py)
        self.costs: dict[tuple[str | None, str], ServiceCosts] = {}
        self.recent_outputs = RecentOutputs()  # one per worker: its latest outputs, for the suffix drafter
        self.services: dict[str, Service] = {}  # per replica address: its channel, stub and Info
        self.pairs: dict[tuple[str | None, str], ServicePair] = {}
        self.connecting = asyncio.Lock()

    async def ready(self) -> bool:
        for target in self.targets:
            for draft in self.drafts or [None]:
                await self._connect(draft, target)
        return True

    async def generate(self, request: GenerationRequest, trace_carrier: dict[str, str] | None = None):
        """The request's events; `trace_carrier`: the caller's trace context (tracing.carrier)."""
        target = request.target or self.targets[0]
        draft = (request.draft or self.drafts[0]) if self.drafts else None
        pair = await self._connect(draft, target)
        generation = Generation(
            request,
            pair.draft_stub,
            pair.target_stub,
            pair.tokenizer,
            set(pair.target_info.eos_token_ids),
            self.policy,
            self.draft_gates.get(draft),
            self.costs[draft, target],
            trace_parent=tracing.parent(trace_carrier),
            recent=self.recent_outputs,
            rebind=lambda failed: self._rebind(request.spare_drafts, failed, target),
        )
        try:
            async for event in generation.run():
                yield event
        except ServiceFailed as failure:
            yield Failed(failure.code.name, str(failure), failure.service)
        except grpc.aio.AioRpcError as error:
            yield Failed(error.code().name, f"{error.details()} (from a model service)")

    async def _rebind(self, spares: list[str], failed: str, target: str) -> DraftBinding | None:
        """The first of the pool's spare draft replicas this worker has no failure on record for and
        that answers (REBIND_CONNECT_S to connect to one not yet connected); None: none."""
        for address in spares:
            gate = self.draft_gates.get(address)
            if address == failed or (gate is not None and not gate.is_open()):
                continue
            try:
                pair = await self._connect(address, target, REBIND_CONNECT_S)
            except (TimeoutError, grpc.aio.AioRpcError, ValueError) as error:
                log.warning("spare draft replica %s does not answer: %s", address, error)
                self.draft_gates.setdefault(address, DraftGate(self.policy)).failed(lost=True)  # not asked again soon
                continue
            return DraftBinding(address, pair.draft_stub, self.draft_gates[address], self.costs[address, target])
        return None

    async def _connect(self, draft: str | None, target: str, timeout_s: float = 600.0) -> ServicePair:
        """The pair of these replicas, each service connected once however many pairs it is in."""
        async with self.connecting:
            if (pair := self.pairs.get((draft, target))) is None:
                services = (
                    await self._service("draft", draft, timeout_s),
                    await self._service("target", target, timeout_s),
                )
                pair = self.pairs[draft, target] = pair_of(*services)
                costs = self.costs[draft, target] = ServiceCosts()
                draft_info = pair.draft_info if pair.has_draft else None
                costs.seed(
                    draft_info.pass_seconds if draft_info else (),
                    pair.target_info.pass_seconds,
                    draft_info.prefill_seconds_per_token if draft_info else 0.0,
                    pair.target_info.pass_positions,
                )
                if pair.has_draft:
                    self.draft_gates.setdefault(draft, DraftGate(self.policy))
                    costs.shared_cores = share_cores(draft, target, pair.draft_info, pair.target_info)
                costs.splits_rows = pair.target_info.splits_rows
            return pair

    async def _service(self, role: str, address: str | None, timeout_s: float) -> Service | None:
        if address is None:
            return None
        if (service := self.services.get(address)) is None:
            service = self.services[address] = await connect_service(role, address, timeout_s, self.security)
        return service


def replicas(address: str) -> list[str]:
    """The replicas of a --target or --draft: one address, or several comma-separated (a pool)."""
    found = [part.strip() for part in address.split(",") if part.strip()]
    if not found:
        raise ValueError("--target and --draft take a HOST:PORT (or several, comma-separated)")
    return found


RemoteWorker = ray.remote(GenerationWorker)


RESTART_WAIT_S = 30.0  # how long a request that no actor could start waits for one to restart
REBIND_CONNECT_S = 2.0  # how long a request leaving a failed draft waits to connect to a spare one


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
        otlp_endpoint: str | None = None,
        routing: str = ROUTINGS[0],
        metrics=None,
        migration_limit: int = MIGRATION_LIMIT,
    ):
        self.actors = [
            RemoteWorker.options(max_concurrency=concurrency, max_restarts=-1, num_cpus=0).remote(
                draft_address, target_address, policy, security, otlp_endpoint
            )
            for _ in range(workers)
        ]
        self.max_requests = max_requests  # requests in flight over all actors; None = no limit
        self.security = security  # to release the sessions of a request whose actor died
        self.in_flight = [0] * workers
        self._turns = itertools.count()  # rotates which actor wins a tie
        # which replicas serve a new request: a target, and a draft where the request asks one
        self.routers = {"target": Router(replicas(target_address), routing=routing)}
        if draft_address:
            self.routers["draft"] = Router(replicas(draft_address), routing=routing)
        self.metrics = metrics  # told each route and each move (OrchestratorMetrics: routed, migrated)
        self.migration_limit = migration_limit  # moves per request off failed target replicas (migration.py)
        self.rejoin = Rejoin(self.routers, security)  # failed replicas, until they serve again

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
        progress = Progress(request, self.migration_limit)
        while True:
            try:
                attempt = self._routed(request, progress)
            except LookupError:
                yield Failed("UNAVAILABLE", "no target replica serves now (each failed, and none is back yet): retry")
                return
            moved = None
            bound = {role: getattr(attempt, role) for role in self.routers}  # the replicas it is on
            try:
                async with contextlib.aclosing(self._on_a_worker(attempt)) as events:
                    async for event in events:
                        if isinstance(event, Rebound):  # it left a failed draft replica: for the router alone
                            self._draft_moved(event, attempt.session_id)
                            bound["draft"] = event.draft
                            continue
                        if isinstance(event, Failed) and progress.moves_on(event, self._others(attempt.target)):
                            moved = event
                            break
                        if isinstance(event, Finished):
                            event.stats.migrations = progress.moves
                        progress.streamed(event)
                        yield event
            finally:
                for role, replica in bound.items():
                    self.routers[role].done(replica)
            if moved is None:
                return
            progress.moves += 1
            failed = attempt.target if moved.service == "target" else "an orchestrator worker"
            if moved.service == "target":
                self.rejoin.failed("target", attempt.target, attempt.session_id)
            log.warning(
                "%s failed a request after %d output tokens (%s): moving it, move %d of %d",
                failed,
                len(progress.tokens),
                moved.message,
                progress.moves,
                progress.limit,
            )
            if self.metrics:
                self.metrics.migrated(moved.service)

    def _draft_moved(self, event: Rebound, session_id: str) -> None:
        """A request left draft replica `event.failed` for `event.draft`: its load moves, and the failed
        one takes no new request until it serves again."""
        router = self.routers["draft"]
        router.done(event.failed)
        router.placed(event.draft)
        self.rejoin.failed("draft", event.failed, session_id)
        if self.metrics:
            self.metrics.migrated("draft")

    def _routed(self, request: GenerationRequest, progress: Progress) -> GenerationRequest:
        """This attempt of the request, on the replicas the routers choose now (LookupError: no target
        serves): a session id of its own, and what earlier attempts streamed."""
        roles = [role for role in self.routers if role == "target" or request.drafter not in LOOKUP_ONLY]
        routes = {role: self.routers[role].route(request.prompt_ids, request.cache_salt) for role in roles}
        for role, route in routes.items():
            tracing.annotate(**{role: route.replica, f"{role}_route": route.reason})  # the call's span
            if self.metrics:
                self.metrics.routed(role, route)
        first = not progress.moves
        spares = []  # the other draft replicas that serve, the least loaded first
        if "draft" in routes:
            serving = sorted(self.routers["draft"].serving(), key=lambda replica: replica.load)
            spares = [replica.name for replica in serving if replica.name != routes["draft"].replica]
        return dataclasses.replace(
            request,
            session_id=(request.session_id if first else "") or uuid.uuid4().hex,
            resumed=list(progress.tokens),
            # another replica can take it over: a failing target is not waited for the policy's 30 s
            failover=bool(self.migration_limit and self._others(routes["target"].replica)),
            spare_drafts=spares,
            **{role: route.replica for role, route in routes.items()},
        )

    def _others(self, target: str) -> bool:
        """Whether a target replica other than `target` takes new requests."""
        return any(replica.name != target for replica in self.routers["target"].serving())

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
                await self._release(request)
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
                        "worker",  # the pool moves the request on where it may (migration.py)
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

    async def _release(self, request: GenerationRequest) -> None:
        """Release a dead actor's sessions on the request's replicas now rather than at idle eviction."""
        calls = [release_sessions("target", request.target, [request.session_id], self.security)]
        if request.draft:
            calls.append(release_sessions("draft", request.draft, [request.session_id], self.security))
        await asyncio.gather(*calls, return_exceptions=True)

    def shutdown(self) -> None:
        self.rejoin.close()
        for actor in self.actors:
            ray.kill(actor)
