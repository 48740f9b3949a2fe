"""Graceful drain: what a stopping orchestrator does with the requests it runs.

On SIGTERM (a Kubernetes rolling update, `specd up` stopping) the orchestrator stops taking
requests (UNAVAILABLE over gRPC, 503 with Retry-After over HTTP, health NOT_SERVING), lets the
requests in flight finish within --drain-seconds, and ends the rest with UNAVAILABLE and a message
saying so. A client never waits on a server that has gone, and no stream stops without a word.

Both APIs start every request through `Core.start`, which asks `Drain.refusal` first and wraps the
request's events in `Drain.track`: the one place that knows what is in flight.
"""

import asyncio
import time
from contextlib import suppress

from specd.orchestrator.request import Failed

POLL_S = 0.05  # how often a drain looks whether the requests in flight have ended
CUT_GRACE_S = 2.0  # after the cut, how long the cut streams get to send their UNAVAILABLE

DRAINING = "the server is draining (shutting down): it takes no new requests; retry on another replica"
SHUT_DOWN = "the server shut down before the request finished (--drain-seconds {seconds:g}); retry the request"

_END = object()  # what anext() returns at the end of a request's events


class _InFlight:
    """One request being served: `cut` is set when the drain ends it."""

    def __init__(self):
        self.cut = asyncio.Event()


class Drain:
    """The requests in flight, and the draining state of the server that runs them."""

    def __init__(self):
        self.draining = False  # refuse new requests; those in flight go on
        self.closed = ""  # once the drain is over: the message that ends any request still arriving
        self.in_flight: set[_InFlight] = set()
        self.ended = 0  # requests that ended by themselves (finished, failed, cancelled by their client)
        self._hurry = False  # a second signal: end the drain now

    def refusal(self) -> str | None:
        """Why a new request is refused (UNAVAILABLE), or None while serving."""
        return DRAINING if self.draining else None

    async def track(self, events):
        """`events` passed through, unless the drain ends the request first: then the request is
        stopped (its generation loop cancelled, as when a client leaves) and its last event is
        Failed(UNAVAILABLE, SHUT_DOWN). Registered at its first read, as its generation starts."""
        if self.closed:  # admitted just before the drain, first read after it ended
            await events.aclose()
            yield Failed("UNAVAILABLE", self.closed)
            return
        request = _InFlight()
        self.in_flight.add(request)
        cut = asyncio.ensure_future(request.cut.wait())
        step, was_cut = None, False
        try:
            while True:
                step = asyncio.ensure_future(anext(events, _END))
                await asyncio.wait((step, cut), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # cut: stop the generation, then say why
                    await _cancel(step)
                    await events.aclose()  # its worker stops and releases its sessions
                    was_cut = True
                    self.in_flight.discard(request)  # it has ended: the drain need not wait for the client
                    yield Failed("UNAVAILABLE", self.closed)
                    return
                event = step.result()
                if event is _END:
                    return
                yield event
        finally:
            if request in self.in_flight and not was_cut:
                self.ended += 1
            self.in_flight.discard(request)
            cut.cancel()
            if step is not None and not step.done():  # the client left while a step ran
                await _cancel(step)
            await events.aclose()

    async def drain(self, seconds: float) -> tuple[int, int]:
        """Refuse new requests, wait up to `seconds` for those in flight to end, then cut the rest.

        Returns (finished, cut): the requests in flight at the start that ended by themselves, and
        those the drain ended.
        """
        self.draining = True
        ended = self.ended
        deadline = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(POLL_S)
        left = list(self.in_flight)
        self.closed = SHUT_DOWN.format(seconds=seconds)
        for request in left:
            request.cut.set()
        deadline = time.monotonic() + CUT_GRACE_S
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return self.ended - ended, len(left)

    def hurry(self) -> None:
        """End a drain now (a second SIGTERM or Ctrl-C): cut what is still running."""
        self._hurry = True


async def _cancel(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has stopped, whatever it raised."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        with suppress(BaseException):
            task.result()  # retrieved: no "exception was never retrieved" at exit
