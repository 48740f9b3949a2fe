"""One request's session on one model service: the record of what the service holds, and every call on it.

The orchestrator owns the committed tokens. For each service a RemoteSession keeps a *record*:
the tokens that service holds KV for, as far as the orchestrator can vouch. Each call
  1. starts at the longest prefix the record shares with the committed tokens (that is the
     rollback: the service truncates there) and always sends at least the last committed
     token: no side holds its KV yet, the service continues from it (docs/architecture.md §3 rule 6);
  2. rewrites the record from the reply's own `cached_tokens`: the service holds the first
     cached_tokens of (the committed tokens + the tokens it answered). A count past what the
     orchestrator can account for is not believed: the record empties, so the next call resends
     everything rather than trust a cache it cannot vouch for;
  3. when the service disagrees, resyncs and sends again: FAILED_PRECONDITION says what the
     service holds (the record becomes the committed prefix it still shares), NOT_FOUND means
     it holds nothing (restart, eviction: everything again, from token 0).
Nothing is lost and nothing is silently wrong: every cursor carries a fingerprint the service
checks (docs/architecture.md §3). Timeouts, retries and back-off follow faults.py's policy.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from specd.orchestrator.costs import PassCost
from specd.orchestrator.faults import Backoff, FaultPolicy, ServiceFailed
from specd.proto.contract import (
    HELD_FINGERPRINT_KEY,
    HELD_TOKENS_KEY,
    LIVE_SESSIONS_KEY,
    PASS_CALLS_KEY,
    PASS_SECONDS_KEY,
    PASS_TOKENS_KEY,
    SERVICE_SECONDS_KEY,
    fingerprint,
)
from specd.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger("specd.orchestrator")

RESYNC_ATTEMPTS = 3
RESYNC_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
RELEASE_TIMEOUT_S = 5.0
SPENT_S = 0.01  # a request with this little time left is out of time


class RemoteSession:
    """One service's session for one request: one method per RPC, and the record they keep."""

    def __init__(
        self,
        stub,
        session_id: str,
        seconds_left: Callable[[], float | None] = lambda: None,
        name: str = "service",
        policy: FaultPolicy = FaultPolicy(),
        required: bool = True,
        salt: str = "",
    ):
        self.stub = stub  # DraftServiceStub or TargetServiceStub
        self.session_id = session_id
        self.salt = salt  # the request's cache_salt: every cursor carries it (the service's prefix cache)
        self.seconds_left = seconds_left  # of the request's deadline (None: no deadline)
        self.name = name  # "draft" or "target", for messages
        self.policy = policy
        self.retry_window_s = policy.target_retry_s if required else 0.0  # the draft is optional: no retries
        self.step_deadline = False  # Verify and Decode capped by the step deadline (`failover`)
        self.held: list[int] | None = None  # the record; None: no session there yet (or lost): send from 0
        self.opened = False  # a call that may have opened it was sent: Release at the end
        self.resyncs = 0
        self.last_pass: PassCost | None = None  # the batched pass that served the last call, as it said
        # Of the tokens of the first call that opened the session (a cursor from token 0, the prompt's
        # prefill), those the service took from its prefix cache, as it said; None: no such reply yet
        self.cached_prompt_tokens: int | None = None

    def timeout(self, cap: float | None = None) -> float:
        """Timeout of one call: min(seconds left of the request's deadline, the per-call cap)."""
        cap = self.policy.call_timeout_s if cap is None else cap
        left = self.seconds_left()
        return cap if left is None else min(left, cap)

    def failover(self) -> None:
        """Another replica can take this request over: give a failing service up sooner (the policy's
        failover retry window, and the step deadline on each Verify or Decode; faults.py)."""
        self.retry_window_s = min(self.retry_window_s, self.policy.failover_retry_s)
        self.step_deadline = True

    def step_timeout(self, cursor: common_pb2.SessionCursor) -> float:
        """The timeout of a Verify or Decode sending this cursor."""
        return self.timeout(self.policy.step_cap(len(cursor.tokens)) if self.step_deadline else None)

    def cursor(self, committed: list[int]) -> common_pb2.SessionCursor:
        """Keep the agreed prefix, send the rest; always send >= 1 token (the last committed)."""
        start = min(_common_prefix(self.held or [], committed), len(committed) - 1)
        return common_pb2.SessionCursor(
            session_id=self.session_id,
            start=start,
            fingerprint=fingerprint(committed[:start]),
            tokens=committed[start:],
            cache_salt=self.salt,
        )

    def behind(self, committed: list[int]) -> int:
        """Committed tokens the next call must send beyond the last one (which every call sends):
        what the service has to catch up on first."""
        return len(committed) - 1 - self.cursor(committed).start

    # -- one method per RPC ----------------------------------------------------------------------
    # Each returns (reply, seconds the service says it spent, or None), and raises ServiceFailed
    # when the service refuses for good or stays unavailable past the retry window.

    async def prefill(self, committed: list[int]) -> None:
        """Open the session ahead, holding the committed tokens but the last (the first call sends
        that one). Optional: a first call without it opens the session from token 0 itself."""
        await self._retrying(lambda: self._open(committed))

    async def propose(self, committed: list[int], k: int, sampling: common_pb2.SamplingParams):
        """Draft: K guesses after the committed tokens (and, when sampling, their q rows)."""
        reply, seconds = await self._call(
            committed,
            lambda cursor: self.stub.Propose(
                draft_pb2.ProposeRequest(cursor=cursor, num_draft_tokens=k, sampling=sampling),
                timeout=self.timeout(self.policy.propose_cap(len(cursor.tokens))),
            ),
        )
        self._record(committed + list(reply.draft_tokens), reply.cached_tokens)
        return reply, seconds

    async def verify(self, committed: list[int], draft_tokens, q, sampling: common_pb2.SamplingParams, **options):
        """Target: the accepted guesses plus its own token, scored in one pass; `options`: more
        VerifyRequest fields (return_logprobs, top_logprobs)."""
        reply, seconds = await self._call(
            committed,
            lambda cursor: self.stub.Verify(
                target_pb2.VerifyRequest(cursor=cursor, draft_tokens=draft_tokens, q=q, sampling=sampling, **options),
                timeout=self.step_timeout(cursor),
            ),
        )
        self._record(committed + list(reply.emitted_tokens), reply.cached_tokens)
        return reply, seconds

    async def decode(self, committed: list[int], sampling: common_pb2.SamplingParams, **options):
        """Target, speculation off: one token of its own, or a run of them (`steps`, with the
        `stop_token_ids` that end it early); `options`: more DecodeRequest fields."""
        reply, seconds = await self._call(
            committed,
            lambda cursor: self.stub.Decode(
                target_pb2.DecodeRequest(cursor=cursor, sampling=sampling, **options),
                timeout=self.step_timeout(cursor),
            ),
        )
        self._record(committed + list(reply.emitted_tokens), reply.cached_tokens)
        return reply, seconds

    async def release(self, committed: list[int] | None = None) -> None:
        """End the session; `committed`: the request's tokens, which the service's prefix cache may keep
        for a conversation's next turn (common.proto ReleaseRequest)."""
        if self.opened:
            self.opened = False
            request = common_pb2.ReleaseRequest(session_id=self.session_id, committed=committed or ())
            await self.stub.Release(request, timeout=RELEASE_TIMEOUT_S)

    # -- the record ----------------------------------------------------------------------------

    def _record(self, known: list[int], cached: int) -> None:
        """The service says it holds KV for `cached` tokens: the first ones of `known` (what the
        orchestrator sent or was answered). More than that cannot be vouched for: keep nothing, so
        the next call resends from token 0 (the service truncates to it) instead of trusting it."""
        if cached <= len(known):
            self.held = known[:cached]
            return
        self.held = []
        self.resyncs += 1
        log.warning(
            "the %s service says session %s holds %d tokens, the orchestrator knows of %d: resending all",
            self.name,
            self.session_id,
            cached,
            len(known),
        )

    async def _open(self, committed: list[int]) -> None:
        tokens = committed[:-1]
        cursor = common_pb2.SessionCursor(
            session_id=self.session_id, start=0, fingerprint=0, tokens=tokens, cache_salt=self.salt
        )
        self.opened = True  # before the call: a reply lost after the service opened it still gets a Release
        reply = await self.stub.Prefill(common_pb2.PrefillRequest(cursor=cursor), timeout=self.timeout())
        self._record(tokens, reply.cached_tokens)

    async def _call(self, committed: list[int], send: Callable[[common_pb2.SessionCursor], grpc.aio.UnaryUnaryCall]):
        """send(cursor) for the committed tokens, resyncing the session when the service disagrees."""
        resyncs_left = RESYNC_ATTEMPTS

        async def attempt():
            nonlocal resyncs_left
            while True:
                try:
                    if self.held is None:  # new, restarted or evicted: the call from token 0 is its prefill
                        self.held, self.opened = [], True  # opened before the call: a lost reply still gets a Release
                    cursor = self.cursor(committed)
                    reply, seconds, self.last_pass = await _served(send(cursor))
                    if cursor.start == 0 and self.cached_prompt_tokens is None:  # the call that opened it
                        self.cached_prompt_tokens = getattr(reply, "cached_prompt_tokens", 0)
                    return reply, seconds
                except grpc.aio.AioRpcError as error:
                    if not resyncs_left or error.code() not in RESYNC_CODES:
                        raise
                    resyncs_left -= 1
                    self.resyncs += 1
                    lost = error.code() == grpc.StatusCode.NOT_FOUND
                    self.held = None if lost else _agreed_prefix(error, committed)

        return await self._retrying(attempt)

    # -- faults --------------------------------------------------------------------------------

    async def _retrying(self, attempt: Callable[[], Awaitable]):
        """attempt() until it answers; transient failures are retried with back-off in the window."""
        if self.spent():  # a call that can only time out is not sent: the request ends DEADLINE_EXCEEDED
            raise ServiceFailed(
                self.name,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request's deadline passed before the {self.name} call",
            )
        backoff, started = Backoff(self.retry_window_s), time.monotonic()
        while True:
            try:
                return await attempt()
            except grpc.aio.AioRpcError as error:
                pause = backoff.next_pause(self.seconds_left()) if self._transient(error) else None
                if pause is None:
                    raise self._failed(error, backoff.attempts, time.monotonic() - started) from error
                await asyncio.sleep(pause)

    def spent(self) -> bool:
        """The request's deadline has passed, or is within 10 ms: too close for a call."""
        left = self.seconds_left()
        return left is not None and left <= SPENT_S

    def _transient(self, error: grpc.aio.AioRpcError) -> bool:
        """Unavailable (restarting, unreachable), cancelled by the service (a server stopping cancels
        its calls in flight; this request's own cancellation never arrives as an error), or slower
        than the per-call cap while the request has time."""
        if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return True
        return error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not self.spent()

    def _failed(self, error: grpc.aio.AioRpcError, retries: int, seconds: float) -> ServiceFailed:
        # A call past its cap with the request's time left (transient) is the service not answering: UNAVAILABLE,
        # retried or not (a cap as long as the retry window leaves none), never the client's DEADLINE_EXCEEDED
        if self._transient(error) and (retries or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
            return ServiceFailed(
                self.name,
                grpc.StatusCode.UNAVAILABLE,
                (
                    f"the {self.name} service did not answer for {seconds:.1f} s over {retries + 1} attempts "
                    f"(last: {error.code().name}: {error.details()}); the request was stopped, retry it"
                ),
            )
        return ServiceFailed(self.name, error.code(), f"{error.details()} (from the {self.name} service)")


async def _served(call: grpc.aio.UnaryUnaryCall) -> tuple:
    """Await a call; returns (reply, seconds the service says it spent on it or None, the pass
    that served it or None)."""
    reply = await call
    said = dict(await call.trailing_metadata() or ())
    seconds = said.get(SERVICE_SECONDS_KEY)
    try:
        served = PassCost(
            int(said[PASS_CALLS_KEY]),
            int(said[PASS_TOKENS_KEY]),
            float(said[PASS_SECONDS_KEY]),
            int(said.get(LIVE_SESSIONS_KEY, said[PASS_CALLS_KEY])),
        )
    except (KeyError, ValueError):
        served = None
    return reply, None if seconds is None else float(seconds), served


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
