"""One request's view of a remote session: what we believe the service holds, and resync.

The orchestrator owns the committed tokens. For each service it keeps a *mirror*: the tokens
it believes that service has cached. Every call starts at the longest prefix the mirror shares
with the committed tokens (that is the rollback: the service truncates there). When the
service says otherwise (FAILED_PRECONDITION / NOT_FOUND after a restart, eviction or a lost
reply) the mirror is corrected from what the service reports and the call is sent again, at
worst from token 0. Nothing is lost and nothing is silently wrong (docs/architecture.md §3).
"""

import asyncio
import time
from typing import Awaitable, Callable

import grpc

from specd.proto.contract import HELD_FINGERPRINT_KEY, HELD_TOKENS_KEY, fingerprint
from specd.orchestrator.faults import Backoff, FaultPolicy, ServiceFailed
from specd.v1 import common_pb2

RESYNC_ATTEMPTS = 3
RELEASE_TIMEOUT_S = 5.0


class RemoteSession:
    def __init__(self, stub, session_id: str, seconds_left: Callable[[], float | None] = lambda: None,
                 name: str = "service", policy: FaultPolicy = FaultPolicy(), required: bool = True):
        self.stub = stub  # DraftServiceStub or TargetServiceStub
        self.session_id = session_id
        self.seconds_left = seconds_left  # of the request's deadline (None: no deadline)
        self.name = name  # "draft" or "target", for messages
        self.policy = policy
        self.retry_window_s = policy.target_retry_s if required else 0.0  # the draft is optional: no retries
        self.mirror: list[int] = []  # tokens we believe the service caches
        self.opened = False  # a Prefill was sent: Release at the end
        self.lost = False  # the service said it has no such session: re-prefill before the next call
        self.resyncs = 0

    def timeout(self, cap: float | None = None) -> float:
        """Timeout of one call: min(seconds left of the request's deadline, the per-call cap)."""
        cap = self.policy.call_timeout_s if cap is None else cap
        left = self.seconds_left()
        return cap if left is None else min(left, cap)

    def cursor(self, committed: list[int]) -> common_pb2.SessionCursor:
        """Keep the agreed prefix, send the rest; always send >= 1 token (the last committed)."""
        start = min(_common_prefix(self.mirror, committed), len(committed) - 1)
        return common_pb2.SessionCursor(
            session_id=self.session_id, start=start, fingerprint=fingerprint(committed[:start]),
            tokens=committed[start:],
        )

    async def prefill(self, tokens: list[int]) -> None:
        """Open the session holding `tokens` (the prompt minus its last token)."""
        await self._retrying(lambda: self._open(tokens))

    async def call(self, committed: list[int], send: Callable[[common_pb2.SessionCursor], Awaitable]):
        """send(cursor) with the committed tokens, resyncing the session when the service disagrees.

        Raises ServiceFailed when the service refuses for good, or stays unavailable longer
        than the retry window (a required service) or at all (an optional one).
        """
        resyncs_left = RESYNC_ATTEMPTS

        async def attempt():
            nonlocal resyncs_left
            while True:
                try:
                    if self.lost:
                        await self._open(committed[:-1])  # restarted or evicted: full re-prefill
                    return await send(self.cursor(committed))
                except grpc.aio.AioRpcError as error:
                    code = error.code()
                    if not resyncs_left or code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                        raise
                    resyncs_left -= 1
                    self.resyncs += 1
                    if code == grpc.StatusCode.NOT_FOUND:
                        self.lost = True
                    else:
                        self.mirror = _agreed_prefix(error, committed)

        return await self._retrying(attempt)

    async def release(self) -> None:
        if self.opened:
            self.opened = False
            await self.stub.Release(common_pb2.ReleaseRequest(session_id=self.session_id),
                                    timeout=RELEASE_TIMEOUT_S)

    async def _open(self, tokens: list[int]) -> None:
        cursor = common_pb2.SessionCursor(session_id=self.session_id, start=0, fingerprint=0, tokens=tokens)
        self.opened = True  # before the call: a reply lost after the service opened it still gets a Release
        await self.stub.Prefill(common_pb2.PrefillRequest(cursor=cursor), timeout=self.timeout())
        self.mirror, self.lost = list(tokens), False

    async def _retrying(self, attempt: Callable[[], Awaitable]):
        """attempt() until it answers; transient failures are retried with back-off in the window."""
        backoff, started = Backoff(self.retry_window_s), time.monotonic()
        while True:
            try:
                return await attempt()
            except grpc.aio.AioRpcError as error:
                pause = backoff.next_pause(self.seconds_left()) if self._transient(error) else None
                if pause is None:
                    raise self._failed(error, backoff.attempts, time.monotonic() - started) from error
                await asyncio.sleep(pause)

    def _transient(self, error: grpc.aio.AioRpcError) -> bool:
        """Unavailable (restarting, unreachable), or slower than the per-call cap while the request has time."""
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            return True
        left = self.seconds_left()
        return error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (left is None or left > 0.01)

    def _failed(self, error: grpc.aio.AioRpcError, retries: int, seconds: float) -> ServiceFailed:
        if retries and self._transient(error):
            return ServiceFailed(self.name, grpc.StatusCode.UNAVAILABLE, (
                f"the {self.name} service did not answer for {seconds:.1f} s over {retries + 1} attempts "
                f"(last: {error.code().name}: {error.details()}); the request was stopped, retry it"))
        return ServiceFailed(self.name, error.code(), f"{error.details()} (from the {self.name} service)")


def _agreed_prefix(error: grpc.aio.AioRpcError, committed: list[int]) -> list[int]:
    """From what a refusing service says it holds, the committed prefix it still shares with us."""
    held = dict(error.trailing_metadata() or ())
    try:
        count, print_ = int(held[HELD_TOKENS_KEY]), int(held[HELD_FINGERPRINT_KEY])
    except (KeyError, ValueError):
        return []
    if count < len(committed) and fingerprint(committed[:count]) == print_:
        return committed[:count]
    return []  # it holds something we never committed (or more than we have): start over


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
