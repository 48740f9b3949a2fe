"""Fake model services for the orchestrator's tests, no servers (tests/test_remote_session.py,
test_generation_fakes.py, test_suffix.py, test_decode_runs.py).

FakeService is a hand-written stand-in for a model service's stub that keeps sessions the way
the real services do (docs/architecture.md §3): truncate to the cursor's `start`, check the
fingerprint, append, answer with `cached_tokens`, refuse with FAILED_PRECONDITION (saying what it
holds) or NOT_FOUND. Its "model" is a rule over the tokens it holds, so a wrong cursor gives
wrong tokens. Faults are injected as real grpc.aio.AioRpcError.
"""

import asyncio

import grpc

from specd.orchestrator.faults import FaultPolicy
from specd.proto.contract import HELD_FINGERPRINT_KEY, HELD_TOKENS_KEY, SERVICE_SECONDS_KEY, fingerprint
from specd.v1 import common_pb2, draft_pb2, target_pb2

Code = grpc.StatusCode
GREEDY = common_pb2.SamplingParams()
PROMPT = [11, 12, 13, 14, 15]
SESSION = "s1"


def target_rule(tokens: list[int]) -> int:
    """The target's next token after `tokens` (a deterministic stand-in for a model)."""
    return (sum(tokens) * 7 + len(tokens)) % 50 + 1


def draft_rule(tokens: list[int]) -> int:
    """The draft agrees with the target except at every third position."""
    token = target_rule(tokens)
    return token if len(tokens) % 3 else token % 50 + 2


def error(code: grpc.StatusCode, held: list[int] | None = None) -> grpc.aio.AioRpcError:
    """A real AioRpcError; with `held`, the trailing metadata a refusing service sets."""
    metadata = []
    if held is not None:
        metadata = [(HELD_TOKENS_KEY, str(len(held))), (HELD_FINGERPRINT_KEY, str(fingerprint(held)))]
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*metadata), f"injected {code.name}")


class FakeCall:
    """What a grpc.aio stub method returns: await it for the reply; then its trailing metadata."""

    def __init__(self, outcome, seconds: float | None = None, delay: float = 0.0):
        self.outcome = outcome
        self.delay = delay  # seconds before it answers
        self.metadata = grpc.aio.Metadata(*([] if seconds is None else [(SERVICE_SECONDS_KEY, f"{seconds:.6f}")]))

    def __await__(self):
        return self._result().__await__()

    async def _result(self):
        await asyncio.sleep(self.delay)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    async def trailing_metadata(self):
        return self.metadata


class FakeService:
    """A DraftServiceStub / TargetServiceStub stand-in with real session semantics (greedy only)."""

    def __init__(self, rule=target_rule, seconds: float | None = 0.002):
        self.rule = rule
        self.seconds = seconds  # reported as the service's own seconds (None: not said)
        self.sessions: dict[str, list[int]] = {}
        self.calls: list[tuple[str, object, float | None]] = []  # (method, request, timeout)
        self.failures: dict[str, list[grpc.aio.AioRpcError]] = {}  # method -> errors its next calls raise
        self.claim: int | None = None  # answer this cached_tokens once instead of the truth
        self.delays: dict[str, float] = {}  # method -> seconds its calls take
        self.reused: list[int] = []  # cached_prompt_tokens its next calls that open a session answer

    def methods(self) -> list[str]:
        return [method for method, _, _ in self.calls]

    def cursors(self, method: str) -> list[common_pb2.SessionCursor]:
        return [request.cursor for name, request, _ in self.calls if name == method]

    # -- the stub's methods ----------------------------------------------------------------

    def Prefill(self, request, timeout=None):
        return self._answer("Prefill", request, timeout, self._prefill)

    def Propose(self, request, timeout=None):
        return self._answer("Propose", request, timeout, self._propose)

    def Verify(self, request, timeout=None):
        return self._answer("Verify", request, timeout, self._verify)

    def Decode(self, request, timeout=None):
        return self._answer("Decode", request, timeout, self._decode)

    def Release(self, request, timeout=None):
        return self._answer(
            "Release",
            request,
            timeout,
            lambda r: common_pb2.ReleaseResponse(released=self.sessions.pop(r.session_id, None) is not None),
        )

    # -- what a service does -------------------------------------------------------------------

    def _answer(self, method: str, request, timeout, handle) -> FakeCall:
        self.calls.append((method, request, timeout))
        delay = self.delays.get(method, 0.0)
        if self.failures.get(method):
            return FakeCall(self.failures[method].pop(0), delay=delay)
        try:
            reply = handle(request)
        except grpc.aio.AioRpcError as refused:
            return FakeCall(refused, delay=delay)
        if self.claim is not None and method != "Release":
            reply.cached_tokens, self.claim = self.claim, None
        if method in ("Verify", "Decode") and request.cursor.start == 0 and self.reused:
            reply.cached_prompt_tokens = self.reused.pop(0)  # this call opened the session: its prefix cache's
        return FakeCall(reply, self.seconds, delay)

    def _sync(self, cursor: common_pb2.SessionCursor) -> list[int]:
        assert cursor.tokens, "every call carries at least the last committed token"
        held = self.sessions.get(cursor.session_id)
        if held is None and cursor.start == 0:  # a call from token 0 opens the session
            held = self.sessions[cursor.session_id] = []
        if held is None:
            raise error(Code.NOT_FOUND)
        if cursor.start > len(held) or fingerprint(held[: cursor.start]) != cursor.fingerprint:
            raise error(Code.FAILED_PRECONDITION, held)
        del held[cursor.start :]  # the rollback
        held += cursor.tokens
        return held

    def _prefill(self, request):
        assert request.cursor.start == 0
        self.sessions[request.cursor.session_id] = list(request.cursor.tokens)
        return common_pb2.PrefillResponse(cached_tokens=len(request.cursor.tokens))

    def _propose(self, request):
        held = self._sync(request.cursor)
        guesses = []
        for _ in range(request.num_draft_tokens):
            guesses.append(self.rule(held + guesses))
        held += guesses[:-1]  # the last guess has no KV
        return draft_pb2.ProposeResponse(draft_tokens=guesses, cached_tokens=len(held))

    def _verify(self, request):
        held = self._sync(request.cursor)
        guesses = list(request.draft_tokens)
        accepted = 0
        while accepted < len(guesses) and self.rule(held + guesses[:accepted]) == guesses[accepted]:
            accepted += 1
        emitted = guesses[:accepted] + [self.rule(held + guesses[:accepted])]
        held += emitted[:-1]  # the recovered or bonus token has no KV yet
        return target_pb2.VerifyResponse(accepted=accepted, emitted_tokens=emitted, cached_tokens=len(held))

    def _decode(self, request):
        held = self._sync(request.cursor)
        return target_pb2.VerifyResponse(accepted=0, emitted_tokens=[self.rule(held)], cached_tokens=len(held))


POLICY = FaultPolicy(propose_timeout_s=0.5, call_timeout_s=5.0, target_retry_s=0.6)


class Tokenless:
    """Enough of a tokenizers.Tokenizer for OutputText: every token is one character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + token % 26) for token in ids)


def target_only(max_new_tokens: int) -> list[int]:
    tokens = list(PROMPT)
    for _ in range(max_new_tokens):
        tokens.append(target_rule(tokens))
    return tokens[len(PROMPT) :]


async def collected(generation) -> tuple[list[int], object]:
    """What a Generation emitted: its tokens, and its final event."""
    tokens, finished = [], None
    async for event in generation.run():
        if hasattr(event, "token_ids"):
            tokens += event.token_ids
        else:
            finished = event
    return tokens, finished
