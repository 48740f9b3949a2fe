"""One request's view of a remote session: what we believe the service holds, and resync.

The orchestrator owns the committed tokens. For each service it keeps a *mirror*: the tokens
it believes that service has cached. Every call starts at the longest prefix the mirror shares
with the committed tokens (that is the rollback: the service truncates there). When the
service says otherwise (FAILED_PRECONDITION / NOT_FOUND after a restart, eviction or a lost
reply) the mirror is corrected from what the service reports and the call is sent again, at
worst from token 0. Nothing is lost and nothing is silently wrong (DESIGN.md §3).
"""

from typing import Awaitable, Callable

import grpc

from specd.contract import HELD_FINGERPRINT_KEY, HELD_TOKENS_KEY, fingerprint
from specd.v1 import common_pb2

RESYNC_ATTEMPTS = 3


class RemoteSession:
    def __init__(self, stub, session_id: str, timeout: Callable[[], float | None] = lambda: None):
        self.stub = stub  # DraftServiceStub or TargetServiceStub
        self.session_id = session_id
        self.timeout = timeout  # seconds left for the request, per call
        self.mirror: list[int] = []  # tokens we believe the service caches
        self.opened = False
        self.resyncs = 0

    def cursor(self, committed: list[int]) -> common_pb2.SessionCursor:
        """Keep the agreed prefix, send the rest; always send >= 1 token (the last committed)."""
        start = min(_common_prefix(self.mirror, committed), len(committed) - 1)
        return common_pb2.SessionCursor(
            session_id=self.session_id, start=start, fingerprint=fingerprint(committed[:start]),
            tokens=committed[start:],
        )

    async def prefill(self, tokens: list[int]) -> None:
        """Open the session holding `tokens` (the prompt minus its last token)."""
        cursor = common_pb2.SessionCursor(session_id=self.session_id, start=0, fingerprint=0, tokens=tokens)
        await self.stub.Prefill(common_pb2.PrefillRequest(cursor=cursor), timeout=self.timeout())
        self.mirror, self.opened = list(tokens), True

    async def call(self, committed: list[int], send: Callable[[common_pb2.SessionCursor], Awaitable]):
        """send(cursor) with the committed tokens, resyncing the session when the service disagrees."""
        for _ in range(RESYNC_ATTEMPTS):
            try:
                return await send(self.cursor(committed))
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    await self.prefill(committed[:-1])  # restarted or evicted: full re-prefill
                elif error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.mirror = _agreed_prefix(error, committed)
                else:
                    raise
                self.resyncs += 1
        return await send(self.cursor(committed))

    async def release(self) -> None:
        if self.opened:
            self.opened = False
            await self.stub.Release(common_pb2.ReleaseRequest(session_id=self.session_id), timeout=5.0)


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
