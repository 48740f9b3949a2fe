"""RemoteSession (orchestrator/sessions.py) against fake services (tests/fake_services.py), no
servers: every test checks that the session's record equals what the fake really holds. Generation
over the same fakes: tests/test_generation_fakes.py.
"""

import time

import pytest
from fake_services import GREEDY, POLICY, PROMPT, SESSION, Code, FakeService, draft_rule, error, target_rule

from specd.orchestrator.faults import CATCHUP_TOKENS_PER_CAP, ServiceFailed
from specd.orchestrator.sessions import RESYNC_ATTEMPTS, RemoteSession
from specd.proto.contract import fingerprint


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


@pytest.mark.serial  # its waits are timed to a few tens of milliseconds: the machine to itself
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


@pytest.mark.serial  # its waits are timed to a few tens of milliseconds: the machine to itself
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


@pytest.mark.serial  # a quarter-second deadline and a tenth of a second of slack: the machine to itself
async def test_the_request_deadline_bounds_the_retries_and_every_timeout():
    target = FakeService()
    deadline = [time.monotonic() + 60.0]
    remote = session(target, seconds_left=lambda: max(0.001, deadline[0] - time.monotonic()))
    await remote.prefill(PROMPT)
    deadline[0] = time.monotonic() + 0.25  # from the decode on
    target.failures = {"Decode": [error(Code.UNAVAILABLE)] * 1000}
    with pytest.raises(ServiceFailed):
        await remote.decode(PROMPT, GREEDY)
    assert time.monotonic() < deadline[0] + 0.1  # not the whole 0.6 s window
    decodes = [timeout for method, _, timeout in target.calls if method == "Decode"]
    assert decodes and all(timeout <= 0.25 for timeout in decodes)


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
