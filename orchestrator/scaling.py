"""specd.v1.Replicas: the pools of target and draft replicas, changed while serving (issue 39,
`specd scale`). The pool's routers own the replicas (router.py); this module checks a replica before
it joins and waits for one to drain as it leaves.

Add: the replica must answer health within ADD_TIMEOUT_S and serve the pool's model (the same model,
vocabulary and tokenizer as the role's replicas, and a pair with the other role's): a replica of
another model would change the output of the requests routed to it. The workers connect to it at its
first request.

Remove: no new request goes there at once; the call answers when the requests on it have ended
(each finishes where it is: its KV lives on that replica) or after `drain_seconds`. Then the replica
can be stopped: its own drain (SIGTERM, issue 18) has nothing left to wait for.
"""

import asyncio
import logging
import time

import grpc

from specd.orchestrator.remote import PairMismatch, ServicePair, check_pair, connect_service
from specd.orchestrator.worker import WorkerPool
from specd.proto.auth import ClientSecurity
from specd.v1 import common_pb2, specdecode_pb2, specdecode_pb2_grpc

ADD_TIMEOUT_S = 10.0  # how long a replica being added gets to answer health
DEFAULT_DRAIN_S = 60.0  # Remove's wait for the requests on a replica, when the call gives none
POLL_S = 0.05

log = logging.getLogger("specd.orchestrator")


class ReplicasServicer(specdecode_pb2_grpc.ReplicasServicer):
    def __init__(self, pool: WorkerPool, pair: ServicePair, security: ClientSecurity = ClientSecurity()):
        self.pool = pool
        self.pair = pair  # the first replicas' Info: what a new replica must match
        self.security = security  # the orchestrator's token and CA, towards the services

    async def List(self, request, context) -> specdecode_pb2.ReplicaList:
        return self._list()

    async def Add(self, request, context) -> specdecode_pb2.ReplicaList:
        router = await self._router(request, context)
        replica = router.replicas.get(request.address)
        if replica is not None and not replica.draining:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"{request.address} is a {request.role} replica already"
            )
        try:
            service = await connect_service(request.role, request.address, ADD_TIMEOUT_S, self.security)
        except (TimeoutError, grpc.aio.AioRpcError) as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot add {request.address}: {error}")
        try:
            self._check(request.role, service.info)
        except PairMismatch as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot add {request.address}: {error}")
        finally:
            await service.channel.close()
        router.add(request.address)
        log.info("%s replica %s added: %d serving", request.role, request.address, len(router.serving()))
        return self._list()

    async def Remove(self, request, context) -> specdecode_pb2.ReplicaList:
        router = await self._router(request, context)
        replica = router.replicas.get(request.address)
        if replica is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.address} is not a {request.role} replica")
        if [r.name for r in router.serving()] == [request.address]:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{request.address} is the last {request.role} replica serving: add another before removing it",
            )
        router.remove(request.address)
        log.info("%s replica %s removed: draining %d requests", request.role, request.address, replica.load)
        deadline = time.monotonic() + (request.drain_seconds or DEFAULT_DRAIN_S)
        while not router.drained(request.address) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if router.drained(request.address):
            log.info("%s replica %s drained", request.role, request.address)
        return self._list()

    async def _router(self, request, context):
        if request.role not in ("target", "draft"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role {request.role!r}: target or draft")
        if request.role not in self.pool.routers:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this orchestrator runs without a draft: it has no draft pool"
            )
        if not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give the replica's HOST:PORT")
        return self.pool.routers[request.role]

    def _check(self, role: str, info: common_pb2.ModelInfo) -> None:
        """The new replica serves the role's model and pairs with the other role (PairMismatch if not)."""
        same = self.pair.draft_info if role == "draft" else self.pair.target_info
        if (info.model, info.tokenizer_fingerprint) != (same.model, same.tokenizer_fingerprint):
            raise PairMismatch(f"it serves {info.model!r}, the pool's {role} replicas serve {same.model!r}")
        if role == "draft":
            check_pair(info, self.pair.target_info)
        elif self.pair.draft_info is not None:
            check_pair(self.pair.draft_info, info)

    def _list(self) -> specdecode_pb2.ReplicaList:
        return specdecode_pb2.ReplicaList(
            replicas=[
                specdecode_pb2.Replica(role=role, address=r.name, in_flight=r.load, draining=r.draining)
                for role, router in self.pool.routers.items()
                for r in router.replicas.values()
            ]
        )
