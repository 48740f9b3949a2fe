"""RemoteSession (orchestrator/sessions.py) against fake services, no servers (Generation over the
same fakes: tests/test_generation_fakes.py).

FakeService is a hand-written stand-in for a model service's stub that keeps sessions the way
the real services do (docs/architecture.md §3): truncate to the cursor's `start`, check the
fingerprint, append, answer with `cached_tokens`, refuse with FAILED_PRECONDITION (saying what it
holds) or NOT_FOUND. Its "model" is a rule over the tokens it holds, so a wrong cursor gives
wrong tokens: every test checks that the session's record equals what the fake really holds.
Faults are injected as real grpc.aio.AioRpcError.
"""

import asyncio
import time

import grpc
import pytest

from specd.orchestrator.faults import CATCHUP_TOKENS_PER_CAP, FaultPolicy, ServiceFailed
from specd.orchestrator.sessions import RESYNC_ATTEMPTS, RemoteSession
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
        self.reused: list[int] = []  # prefix_cached_tokens its next calls that open a session answer

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
            reply.prefix_cached_tokens = self.reused.pop(0)  # this call opened the session: its prefix cache's
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


def session(service: FakeService, required: bool = True, seconds_left=lambda: None) -> RemoteSession:
    return RemoteSession(service, SESSION, seconds_left, "target" if required else "draft", POLICY, required)


def in_sync(remote: RemoteSession, service: FakeService) -> bool:
    """The record is exactly what the service holds."""
    return remote.held == service.sessions.get(SESSION)


# -- the cursor ----------------------------------------------------------------------------------


def test_the_cursor_starts_at_the_agreed_prefix_and_always_sends_a_token():
    remote = session(FakeService())
    committed = [1, 2, 3, 4, 5, 6]
    for held, start in (
        ([], 0),
        ([1, 2, 3], 3),
        ([1, 2, 9, 9], 2),
        ([1, 2, 3, 4, 5, 6], 5),
        ([1, 2, 3, 4, 5, 6, 7, 8], 5),
        ([7], 0),
    ):
        remote.held = held
        cursor = remote.cursor(committed)
        assert (cursor.start, list(cursor.tokens)) == (start, committed[start:]), held
        assert cursor.fingerprint == fingerprint(committed[:start]) and cursor.session_id == SESSION
    remote.held = [5]
    assert list(remote.cursor([5]).tokens) == [5]  # one committed token: it is sent, never "held"


async def test_prefill_holds_all_but_the_last_token_and_the_first_call_sends_it():
    target = FakeService()
    remote = session(target)
    await remote.prefill(PROMPT)
    assert target.sessions[SESSION] == PROMPT[:-1] and in_sync(remote, target) and remote.opened
    reply, seconds = await remote.decode(PROMPT, GREEDY)
    cursor = target.cursors("Decode")[0]
    assert (cursor.start, list(cursor.tokens)) == (len(PROMPT) - 1, PROMPT[-1:])
    assert list(reply.emitted_tokens) == [target_rule(PROMPT)]
    assert seconds == pytest.approx(0.002) and in_sync(remote, target) and remote.held == PROMPT


async def test_a_session_never_prefilled_is_opened_by_its_first_call_from_token_0():
    draft = FakeService(draft_rule)
    remote = session(draft, required=False)
    reply, _ = await remote.propose(PROMPT, 3, GREEDY)
    assert draft.methods() == ["Propose"] and remote.resyncs == 0 and remote.opened
    cursor = draft.cursors("Propose")[0]
    assert (cursor.start, list(cursor.tokens)) == (0, PROMPT)
    assert remote.held == PROMPT + list(reply.draft_tokens[:2]) and in_sync(remote, draft)


# -- the record follows cached_tokens, and rollback ---------------------------------------------


async def test_rejected_guesses_are_rolled_back_by_the_next_cursor():
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    drafter, verifier = session(draft, required=False), session(target)
    committed = list(PROMPT)
    await drafter.prefill(committed)
    await verifier.prefill(committed)
    rejections = 0
    for _ in range(12):
        proposal, _ = await drafter.propose(committed, 4, GREEDY)
        assert drafter.held == committed + list(proposal.draft_tokens[:-1]) and in_sync(drafter, draft)
        verdict, _ = await verifier.verify(committed, proposal.draft_tokens, proposal.q, GREEDY)
        emitted = list(verdict.emitted_tokens)
        assert verifier.held == committed + emitted[:-1] and in_sync(verifier, target)
        rejections += verdict.accepted < 4
        committed = committed + emitted  # shorter than what the draft holds after a rejection
    assert rejections >= 3, "the draft rule disagrees every third position: some guesses were rejected"
    # Each later Propose resent only the target's own token (plus the last guess after an all-accepted
    # step, since that one has no KV): the rest was kept, the rejected guesses were cut.
    assert all(len(cursor.tokens) in (1, 2) for cursor in draft.cursors("Propose")[1:])
    assert drafter.resyncs == verifier.resyncs == 0
    expected = list(PROMPT)
    while len(expected) < len(committed):
        expected.append(target_rule(expected))
    assert committed == expected  # exactly the target's own tokens


async def test_after_all_k_accepted_the_next_cursor_sends_the_last_guess_and_the_bonus():
    draft, target = FakeService(target_rule), FakeService(target_rule)  # a draft that always agrees
    drafter, verifier = session(draft, required=False), session(target)
    proposal, _ = await drafter.propose(PROMPT, 3, GREEDY)
    verdict, _ = await verifier.verify(PROMPT, proposal.draft_tokens, proposal.q, GREEDY)
    assert verdict.accepted == 3
    committed = PROMPT + list(verdict.emitted_tokens)
    await drafter.propose(committed, 2, GREEDY)
    cursor = draft.cursors("Propose")[-1]
    assert cursor.start == len(PROMPT) + 2 and list(cursor.tokens) == committed[-2:]
    assert in_sync(drafter, draft)


async def test_a_cached_tokens_past_what_was_sent_is_not_believed():
    target = FakeService()
    remote = session(target)
    await remote.prefill(PROMPT)
    target.claim = len(PROMPT) + 5  # more than PROMPT + the decoded token
    reply, _ = await remote.decode(PROMPT, GREEDY)
    assert remote.held == [] and remote.resyncs == 1
    committed = PROMPT + list(reply.emitted_tokens)
    await remote.decode(committed, GREEDY)
    cursor = target.cursors("Decode")[-1]
    assert cursor.start == 0 and list(cursor.tokens) == committed  # everything resent
    assert in_sync(remote, target)


async def test_a_cached_tokens_short_of_what_was_sent_keeps_only_that_prefix():
    target = FakeService()
    remote = session(target)
    await remote.prefill(PROMPT)
    target.claim = 2
    reply, _ = await remote.decode(PROMPT, GREEDY)
    assert remote.held == PROMPT[:2]
    target.sessions[SESSION] = PROMPT[:2]  # what it said
    await remote.decode(PROMPT + list(reply.emitted_tokens), GREEDY)
    assert target.cursors("Decode")[-1].start == 2 and in_sync(remote, target) and remote.resyncs == 0


# -- resync ----------------------------------------------------------------------------------


async def test_failed_precondition_resyncs_from_what_the_service_holds():
    target = FakeService()
    remote = session(target)
    await remote.prefill(PROMPT)
    target.sessions[SESSION] = PROMPT[:2]  # it lost its tail (the record says 4 tokens)
    reply, _ = await remote.decode(PROMPT, GREEDY)
    first, second = target.cursors("Decode")
    assert first.start == len(PROMPT) - 1 and second.start == 2 and list(second.tokens) == PROMPT[2:]
    assert list(reply.emitted_tokens) == [target_rule(PROMPT)]
    assert remote.resyncs == 1 and in_sync(remote, target)


async def test_failed_precondition_from_a_service_holding_other_tokens_resends_everything():
    target = FakeService()
    remote = session(target)
    await remote.prefill(PROMPT)
    target.sessions[SESSION] = [99, 98, 97]  # diverged: nothing it holds is ours
    reply, _ = await remote.decode(PROMPT, GREEDY)
    assert target.cursors("Decode")[-1].start == 0 and list(target.cursors("Decode")[-1].tokens) == PROMPT
    assert list(reply.emitted_tokens) == [target_rule(PROMPT)] and in_sync(remote, target)


async def test_not_found_re_prefills_then_sends_again():
    draft = FakeService(draft_rule)
    remote = session(draft, required=False)
    await remote.prefill(PROMPT)
    draft.sessions.clear()  # restarted or evicted
    reply, _ = await remote.propose(PROMPT, 2, GREEDY)
    assert draft.methods() == ["Prefill", "Propose", "Propose"]  # sent again from token 0: that opens it
    assert draft.calls[2][1].cursor.start == 0 and list(draft.calls[2][1].cursor.tokens) == PROMPT
    assert remote.resyncs == 1 and in_sync(remote, draft)
    assert list(reply.draft_tokens) == [draft_rule(PROMPT), draft_rule(PROMPT + [draft_rule(PROMPT)])]


async def test_a_service_that_keeps_disagreeing_fails_the_call():
    target = FakeService()
    remote = session(target)
    await remote.prefill(PROMPT)
    target.failures = {"Decode": [error(Code.NOT_FOUND)] * 10}
    with pytest.raises(ServiceFailed) as failed:
        await remote.decode(PROMPT, GREEDY)
    assert failed.value.code == Code.NOT_FOUND and failed.value.service == "target"
    assert target.methods() == ["Prefill"] + ["Decode"] * (1 + RESYNC_ATTEMPTS)  # a bounded number of tries


# -- faults: the required target retries, the optional draft does not ----------------------------


async def test_an_unavailable_target_is_retried_with_back_off_until_it_answers():
    target = FakeService()
    remote = session(target)
    await remote.prefill(PROMPT)
    target.failures = {"Decode": [error(Code.UNAVAILABLE)] * 3}
    started = time.monotonic()
    reply, _ = await remote.decode(PROMPT, GREEDY)
    waited = time.monotonic() - started
    assert target.methods().count("Decode") == 4
    assert 0.05 + 0.1 + 0.2 - 0.02 <= waited < POLICY.target_retry_s  # 50 ms, doubling
    assert list(reply.emitted_tokens) == [target_rule(PROMPT)] and in_sync(remote, target)


async def test_a_target_unavailable_past_the_window_fails_unavailable():
    target = FakeService()
    remote = session(target)
    await remote.prefill(PROMPT)
    target.failures = {"Decode": [error(Code.UNAVAILABLE)] * 1000}
    started = time.monotonic()
    with pytest.raises(ServiceFailed) as failed:
        await remote.decode(PROMPT, GREEDY)
    waited = time.monotonic() - started
    assert failed.value.code == Code.UNAVAILABLE and "did not answer" in str(failed.value)
    assert POLICY.target_retry_s - 0.05 <= waited < POLICY.target_retry_s + 0.3
    assert target.methods().count("Decode") > 3


async def test_the_request_deadline_bounds_the_retries_and_every_timeout():
    target = FakeService()
    deadline = time.monotonic() + 0.25
    remote = session(target, seconds_left=lambda: max(0.001, deadline - time.monotonic()))
    await remote.prefill(PROMPT)
    target.failures = {"Decode": [error(Code.UNAVAILABLE)] * 1000}
    with pytest.raises(ServiceFailed):
        await remote.decode(PROMPT, GREEDY)
    assert time.monotonic() < deadline + 0.1  # not the whole 0.6 s window
    assert all(timeout <= 0.25 for _, _, timeout in target.calls)


async def test_no_call_is_sent_once_the_request_deadline_has_passed():
    target = FakeService()
    left = [1.0]
    remote = session(target, seconds_left=lambda: left[0])
    await remote.prefill(PROMPT)
    left[0] = 0.001  # what Generation.seconds_left says after the deadline
    with pytest.raises(ServiceFailed) as failed:
        await remote.decode(PROMPT, GREEDY)
    assert failed.value.code == Code.DEADLINE_EXCEEDED and "deadline passed" in str(failed.value)
    assert target.methods() == ["Prefill"]
    await remote.release()  # releasing still goes out
    assert target.methods() == ["Prefill", "Release"]


async def test_an_unavailable_draft_fails_at_once():
    draft = FakeService(draft_rule)
    remote = session(draft, required=False)
    await remote.prefill(PROMPT)
    draft.failures = {"Propose": [error(Code.UNAVAILABLE)]}
    with pytest.raises(ServiceFailed) as failed:
        await remote.propose(PROMPT, 3, GREEDY)
    assert failed.value.service == "draft" and failed.value.code == Code.UNAVAILABLE
    assert draft.methods() == ["Prefill", "Propose"]  # no retry


async def test_a_refusal_is_not_retried():
    target = FakeService()
    remote = session(target)
    await remote.prefill(PROMPT)
    target.failures = {"Decode": [error(Code.RESOURCE_EXHAUSTED)]}
    with pytest.raises(ServiceFailed) as failed:
        await remote.decode(PROMPT, GREEDY)
    assert failed.value.code == Code.RESOURCE_EXHAUSTED and target.methods().count("Decode") == 1


async def test_timeouts_are_the_per_call_caps():
    draft, target = FakeService(draft_rule), FakeService()
    drafter, verifier = session(draft, required=False), session(target)
    await drafter.prefill(PROMPT)
    proposal, _ = await drafter.propose(PROMPT, 2, GREEDY)
    await verifier.prefill(PROMPT)
    await verifier.verify(PROMPT, proposal.draft_tokens, proposal.q, GREEDY)
    await drafter.propose(PROMPT + [7, 8, 9], 2, GREEDY)  # catching up on 3 tokens first: a longer cap
    await drafter.propose(PROMPT + [7, 8, 9] + list(range(100, 2100)), 2, GREEDY)  # on 2,000: a call's cap
    proposes = [timeout for method, _, timeout in draft.calls if method == "Propose"]
    catch_up = POLICY.propose_timeout_s * (1 + 1 / CATCHUP_TOKENS_PER_CAP)  # a cursor of 3: 1 past an in-step 2
    assert proposes == [POLICY.propose_timeout_s, pytest.approx(catch_up), POLICY.call_timeout_s]
    assert {timeout for _, _, timeout in target.calls} == {POLICY.call_timeout_s}


async def test_served_seconds_are_none_when_the_service_does_not_say():
    target = FakeService(seconds=None)
    remote = session(target)
    await remote.prefill(PROMPT)
    assert (await remote.decode(PROMPT, GREEDY))[1] is None


async def test_release_only_what_was_opened_even_if_the_prefill_reply_was_lost():
    target = FakeService()
    remote = session(target)
    await remote.release()
    assert target.methods() == []
    target.failures = {"Prefill": [error(Code.INTERNAL)]}
    with pytest.raises(ServiceFailed):
        await remote.prefill(PROMPT)
    await remote.release()
    await remote.release()
    assert target.methods() == ["Prefill", "Release"]


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
