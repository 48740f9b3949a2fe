"""The model thread: the one thread that runs a model service's calls, behind the scheduler that
batches concurrent ones (model/scheduler.py). It owns the loaded service and its draining
state; refusals leave as status codes (serving/messages.py).
"""

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable

import grpc

from specd.model.errors import EngineError
from specd.model.scheduler import Abandoned, Bounds, Job, Scheduler
from specd.model.service import ModelService
from specd.proto.contract import LIVE_SESSIONS_KEY, PASS_CALLS_KEY, PASS_SECONDS_KEY, PASS_TOKENS_KEY
from specd.serving.messages import abort_with, model_info
from specd.v1 import common_pb2

log = logging.getLogger("specd.serving")


class ModelThread:
    def __init__(self):
        self.scheduler = Scheduler()
        self.service: ModelService | None = None  # None while the model loads
        self.draining = False  # shutting down: the sessions held are still served, no new ones open

    async def load(self, load_service: Callable[[], ModelService]) -> ModelService:
        self.service = await asyncio.wrap_future(self.scheduler.submit(Job(lambda _: [load_service()])))
        limits = self.service.limits
        self.scheduler.bounds = Bounds(limits.max_batch_size, limits.max_batch_tokens, limits.batch_wait_ms / 1000)
        self.scheduler.padded = self.service.engine.description.padded
        self.scheduler.scored_per_call = self.service.engine.description.scored_per_call
        self.scheduler.splits_rows = self.service.engine.description.splits_rows
        self.scheduler.costing = self._opening_cost
        return self.service

    def _opening_cost(self, job: Job) -> int:
        """What a call from token 0 computes: its new tokens less the prompt's prefix that the prefix
        cache would restore (SessionStore.opening_prefix). Asked on the model thread, as the call is taken."""
        call = job.payload
        return call.new_tokens - self.service.store.opening_prefix(call.cursor)[1]

    async def run(self, method: Callable, *args):
        """Run method(service, *args) with no RPC attached (housekeeping)."""
        return await asyncio.wrap_future(self.scheduler.submit(Job(lambda _: [method(self.service, *args)])))

    def later(self, method: Callable, *args) -> None:
        """Queue method(service, *args) with the calls that open requests (model/scheduler.py: a kept
        answer, which the next turn's opening call would otherwise compute); nobody waits for it."""
        try:
            future = self.scheduler.submit(Job(lambda _: [method(self.service, *args)], opens=True))
        except RuntimeError:  # shut down: nothing left to keep up
            return
        future.add_done_callback(_log_failure)

    async def info(self, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        """Answered on the event loop: Info must not wait behind a Verify."""
        if self.service is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; watch grpc.health.v1")
        return model_info(self.service, self.scheduler)

    async def call(self, context: grpc.aio.ServicerContext, method: Callable, *args):
        """Run method(service, *args) alone for an RPC; errors leave as status codes."""
        job = Job(lambda _: [method(self.service, *args)])
        return await self._submit(context, job, ends_session=method is ModelService.release)

    async def batch(self, context: grpc.aio.ServicerContext, batch_method: Callable, call, refusal: bool = False):
        """Run batch_method(service, [call, ...]) for an RPC, sharing the pass with waiting calls.
        refusal: a refused call returns its EngineError instead of ending the RPC with it (a later
        step of a Decode run, which ends with the tokens it has)."""
        run = lambda calls: batch_method(self.service, calls)  # noqa: E731
        session_id, opens = call.cursor.session_id, call.cursor.start == 0  # from token 0: a request's first call
        job = Job(run, call, kind=batch_method, cost=call.new_tokens, session_id=session_id, opens=opens)
        return await self._submit(context, job, refusal=refusal)

    async def _submit(
        self, context: grpc.aio.ServicerContext, job: Job, ends_session: bool = False, refusal: bool = False
    ):
        if self.service is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; watch grpc.health.v1")
        if self.draining and not (ends_session or job.session_id in self.service.store.sessions):
            # A draining service still serves the requests in flight (their sessions' calls and
            # Release), so that they can finish; it opens no session (Prefill, a new call from token 0).
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the model service is draining (shutting down): it serves the sessions it holds but opens no "
                "new ones; use another replica",
            )
        job.abandoned = _abandoned_check(context)
        try:
            result = await asyncio.wrap_future(self.scheduler.submit(job))
            if job.kind is not None:  # a batched call: say what its pass carried and cost
                served = job.served_by
                context.set_trailing_metadata(
                    ((PASS_CALLS_KEY, str(served.calls)), (PASS_TOKENS_KEY, str(served.tokens)),
                     (PASS_SECONDS_KEY, f"{served.seconds:.6f}"),
                     (LIVE_SESSIONS_KEY, str(self.streams())))
                )  # fmt: skip
            return result
        except EngineError as error:
            if refusal:
                return error
            await abort_with(context, error)
        except Abandoned as abandoned:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(abandoned))

    def streams(self) -> int:
        """The sessions this service holds or has calls waiting for (a new stream's first call is
        queued before its session exists): the load the orchestrator's K chooser prices."""
        with self.scheduler.ready:
            waiting = {job.session_id for job in self.scheduler.queue if job.session_id}
        held = self.service.store.sessions  # the model thread changes it: only len() and `in` here
        return len(held) + sum(session_id not in held for session_id in waiting)

    def shutdown(self) -> None:
        self.scheduler.close()


def _log_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("housekeeping on the model thread failed", exc_info=future.exception())


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
