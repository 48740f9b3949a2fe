"""Ray actors that run generation loops; a pool that spreads requests over them.

Each GenerationWorker is an async Ray actor holding its own gRPC channels to the draft and the
target; it runs many requests concurrently (one Generation each) and streams events back
through a Ray streaming generator. Ray places and restarts the actors; the pool only picks the
least busy one.
"""

import asyncio
import itertools
from dataclasses import dataclass

import grpc
import ray

from specd.orchestrator.generation import Generation, GenerationRequest
from specd.orchestrator.remote import connect_pair


@dataclass
class Failed:
    """A service error that ended the request: the status code name and its details."""

    code: str
    message: str


class GenerationWorker:
    def __init__(self, draft_address: str, target_address: str):
        self.addresses = (draft_address, target_address)
        self.pair = None
        self.connecting = asyncio.Lock()

    async def ready(self) -> bool:
        await self._connect()
        return True

    async def generate(self, request: GenerationRequest):
        await self._connect()
        generation = Generation(request, self.pair.draft_stub, self.pair.target_stub, self.pair.tokenizer,
                                set(self.pair.target_info.eos_token_ids))
        try:
            async for event in generation.run():
                yield event
        except grpc.aio.AioRpcError as error:
            yield Failed(error.code().name, f"{error.details()} (from a model service)")

    async def _connect(self) -> None:
        async with self.connecting:
            if self.pair is None:
                self.pair = await connect_pair(*self.addresses)


RemoteWorker = ray.remote(GenerationWorker)


class WorkerPool:
    """N Ray actors; each request goes to the one with the fewest requests in flight."""

    def __init__(self, draft_address: str, target_address: str, workers: int = 2, concurrency: int = 64):
        self.actors = [
            RemoteWorker.options(max_concurrency=concurrency, max_restarts=-1, num_cpus=0).remote(
                draft_address, target_address)
            for _ in range(workers)
        ]
        self.in_flight = [0] * workers
        self._turns = itertools.count()  # rotates which actor wins a tie

    async def ready(self) -> None:
        await asyncio.gather(*(actor.ready.remote() for actor in self.actors))

    async def generate(self, request: GenerationRequest):
        count, first = len(self.actors), next(self._turns)
        index = min(((first + i) % count for i in range(count)), key=lambda i: self.in_flight[i])
        self.in_flight[index] += 1
        stream = self.actors[index].generate.options(num_returns="streaming").remote(request)
        try:
            async for ref in stream:
                yield await ref
        finally:
            self.in_flight[index] -= 1
            ray.cancel(stream)  # a no-op when it finished; on a client cancel it stops the loop

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
