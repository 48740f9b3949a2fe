"""Generation (orchestrator/generation.py) over tests/test_remote_session.py's FakeService, no
servers: exactly the target's tokens at every K, fail-closed on a failing draft and back after it,
both services losing the session mid-request, a draft out of the request's time, and the cache salt
and cached prompt tokens on every cursor."""

import time

import pytest
from fake_services import (
    POLICY,
    PROMPT,
    SESSION,
    Code,
    FakeService,
    Tokenless,
    collected,
    draft_rule,
    error,
    target_only,
    target_rule,
)

from specd.orchestrator.faults import DraftGate, FaultPolicy, ServiceFailed
from specd.orchestrator.generation import Generation, GenerationRequest
from specd.orchestrator.sessions import RemoteSession


async def generate(
    draft: FakeService,
    target: FakeService,
    k: int | None,
    max_new_tokens: int = 30,
    gate: DraftGate | None = None,
    deadline: float | None = None,
    cache_salt: str = "",
):
    request = GenerationRequest(
        prompt_ids=list(PROMPT),
        max_new_tokens=max_new_tokens,
        draft_tokens=k,
        session_id=SESSION,
        ignore_eos=True,
        deadline=deadline,
        cache_salt=cache_salt,
    )
    return await collected(Generation(request, draft, target, Tokenless(), set(), POLICY, gate))


@pytest.mark.parametrize("k", [0, 1, 3, 8, None])
async def test_generation_is_exactly_the_target_for_every_k(k):
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    tokens, finished = await generate(draft, target, k)
    assert tokens == target_only(30)
    assert finished.reason == "length" and finished.completion_tokens == 30
    stats = finished.stats
    assert stats.resyncs == 0 and len(stats.draft_lengths) == stats.steps
    if k:
        assert 0 < stats.accepted < stats.drafted and stats.steps < 30
        assert draft.cursors("Propose")[0].start == 0  # the draft's first Propose opened its session
    if k == 0:
        assert draft.calls == []  # speculation off: the draft is never prefilled nor asked
    assert draft.sessions == {} and target.sessions == {}  # both released


async def test_generation_fails_closed_when_the_draft_fails_and_resumes():
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    draft.failures = {"Propose": [error(Code.UNAVAILABLE)] * 2}
    gate = DraftGate(FaultPolicy(draft_backoff_s=(0.0, 0.0)))  # ask the draft again at the next step
    tokens, finished = await generate(draft, target, 3, gate=gate)
    assert tokens == target_only(30)
    # The first step is target-only by design; the draft's first Propose (from token 0: it opens
    # the session) fails (a target-only step), then the next one (another), then speculation.
    assert finished.stats.draft_lengths[:4] == [0, 0, 0, 3]
    assert draft.methods()[:4] == ["Propose"] * 4
    assert finished.stats.resyncs == 0 and draft.sessions == {}


async def test_a_failed_draft_is_left_alone_for_the_gates_back_off():
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    draft.failures = {"Propose": [error(Code.UNAVAILABLE)]}
    gate = DraftGate(FaultPolicy(draft_backoff_s=(30.0, 30.0)))
    tokens, finished = await generate(draft, target, 3, gate=gate)
    assert tokens == target_only(30)
    # no guess of the draft's after its failure; the prompt lookup (which needs no draft) may guess
    stats = finished.stats
    assert stats.drafted == stats.lookup_drafted and stats.steps == 30 - stats.accepted
    assert draft.methods() == ["Propose", "Release"] and not gate.is_open()


async def test_generation_survives_both_services_losing_the_session_mid_request():
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    original = target._verify
    steps = []

    def forgetful(request):
        steps.append(request)
        if len(steps) == 3:
            draft.sessions.clear()
            target.sessions[SESSION] = target.sessions[SESSION][:3]
        return original(request)

    target._verify = forgetful
    tokens, finished = await generate(draft, target, 3)
    assert tokens == target_only(30)
    assert finished.stats.resyncs >= 2


@pytest.mark.parametrize("deadline_passed", [False, True])
async def test_a_draft_that_runs_out_of_the_requests_time_is_not_blamed(deadline_passed):
    """A Propose that fails because the request's own deadline passed ends the request
    (DEADLINE_EXCEEDED); it neither closes the worker's gate nor sends the target a doomed Decode."""
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    draft.failures = {"Propose": [error(Code.DEADLINE_EXCEEDED)]}
    draft.delays = {"Propose": 0.3}  # it answers after the request's deadline, if it has one
    gate = DraftGate(FaultPolicy(draft_backoff_s=(30.0, 30.0)))
    deadline = time.time() + 0.2 if deadline_passed else None
    if deadline_passed:
        with pytest.raises(ServiceFailed) as failed:
            await generate(draft, target, 3, gate=gate, deadline=deadline)
        assert failed.value.code == Code.DEADLINE_EXCEEDED and failed.value.service == "draft"
        # The first step's Decode (target-only by design), and no doomed one after the failed Propose.
        assert gate.is_open() and target.methods().count("Decode") == 1
    else:  # a slow draft with time left: fail closed, as ever
        tokens, _ = await generate(draft, target, 3, gate=gate, deadline=deadline)
        assert tokens == target_only(30) and not gate.is_open()
    assert draft.sessions == {} and target.sessions == {}  # released either way


# -- the prefix cache: the tenant's salt out, what the target reused back ----------------------------


async def test_every_cursor_carries_the_requests_cache_salt_on_both_services():
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    tokens, finished = await generate(draft, target, 3, cache_salt="tenant-a")
    assert tokens == target_only(30) and finished.stats.drafted > 0
    cursors = draft.cursors("Propose") + target.cursors("Verify") + target.cursors("Decode")
    assert len(cursors) > 3 and {cursor.cache_salt for cursor in cursors} == {"tenant-a"}
    service = FakeService()
    await RemoteSession(service, SESSION, lambda: None, "target", POLICY, salt="tenant-b").prefill(PROMPT)
    assert service.cursors("Prefill")[0].cache_salt == "tenant-b"
    unsalted = FakeService(target_rule)
    await generate(FakeService(draft_rule), unsalted, 0, max_new_tokens=3)
    assert {cursor.cache_salt for cursor in unsalted.cursors("Decode")} == {""}


async def test_the_prompt_tokens_the_target_reused_are_the_requests_cached_prompt_tokens():
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    target.reused = [3]
    _, finished = await generate(draft, target, 3)
    assert finished.cached_prompt_tokens == 3 and finished.prompt_tokens == len(PROMPT)
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    _, finished = await generate(draft, target, 3)
    assert finished.cached_prompt_tokens == 0  # the target said nothing: none


async def test_after_a_resync_the_first_opening_calls_count_stands():
    """The session lost mid-request and opened again from token 0 (its re-prefill may reuse more,
    the output too): the request's cached prompt tokens stay those of the call that opened it first."""
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    target.reused = [2, 9]
    original = target._decode

    def forgetful(request):
        if len(target.cursors("Decode")) == 3:
            target.sessions.clear()  # NOT_FOUND: the next call opens it again from token 0
        return original(request)

    target._decode = forgetful
    tokens, finished = await generate(draft, target, 0, max_new_tokens=6)
    assert tokens == target_only(6) and finished.stats.resyncs >= 1
    assert [cursor.start for cursor in target.cursors("Decode")].count(0) == 2  # opened twice
    assert target.reused == [] and finished.cached_prompt_tokens == 2


async def test_cached_prompt_tokens_never_exceed_the_prompt():
    draft, target = FakeService(draft_rule), FakeService(target_rule)
    target.reused = [len(PROMPT) + 7]  # what no opening call of this prompt could reuse; trust only the prompt's
    _, finished = await generate(draft, target, 0, max_new_tokens=2)
    assert finished.cached_prompt_tokens == len(PROMPT)
