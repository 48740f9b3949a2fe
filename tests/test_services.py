"""Draft and target services in-process on port 0 with tiny models: the consistency contract, on
each engine (conftest.SERVICE_ENGINES: transformers, and llama.cpp over the same weights in a GGUF)."""

import asyncio

import grpc
import numpy as np
import pytest
from conftest import SERVICE_ENGINES, serve_engines, start_services
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specd.proto.contract import HELD_TOKENS_KEY, fingerprint
from specd.proto.limits import Limits
from specd.v1 import common_pb2, draft_pb2, target_pb2

PROMPT = [785, 8251, 7640, 389, 279, 5837, 13, 576]
GREEDY = common_pb2.SamplingParams()


def cursor(session: str, committed: list[int], start: int) -> common_pb2.SessionCursor:
    """Keep the first `start` committed tokens, send the rest."""
    return common_pb2.SessionCursor(
        session_id=session, start=start, fingerprint=fingerprint(committed[:start]), tokens=committed[start:]
    )


async def prefill(stub, session: str, tokens: list[int]) -> int:
    response = await stub.Prefill(common_pb2.PrefillRequest(cursor=cursor(session, tokens, 0)))
    return response.cached_tokens


async def target_greedy(services, tokens: list[int], n: int, session: str = "reference") -> list[int]:
    """n plain decode steps: the target's own greedy continuation."""
    committed = list(tokens)
    await prefill(services.target, session, committed[:-1])
    for _ in range(n):
        start = len(committed) - 1
        reply = await services.target.Decode(target_pb2.DecodeRequest(cursor=cursor(session, committed, start)))
        committed += reply.emitted_tokens
    await services.target.Release(common_pb2.ReleaseRequest(session_id=session))
    return committed[len(tokens) :]


async def verify(services, session, committed, start, drafts, **extra):
    request = target_pb2.VerifyRequest(cursor=cursor(session, committed, start), draft_tokens=drafts, **extra)
    return await services.target.Verify(request)


async def expect_status(code: grpc.StatusCode, call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    assert caught.value.details(), "every refusal says why"
    return caught.value


@pytest.fixture(params=SERVICE_ENGINES)
async def tiny_services(request, tiny_engines):
    """conftest's tiny_services, once per engine."""
    engines = tiny_engines(request.param)
    services = await serve_engines(engines["draft"], engines["target"], Limits(max_sessions=8))
    yield services
    await services.close()


async def test_health_serving_and_reflection_without_project_stubs(tiny_services):
    for port in (tiny_services.draft_server.port, tiny_services.target_server.port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # A client that knows nothing of specd finds both services and their methods by reflection
    # (a blocking client, so it runs beside the event loop that serves it).
    found = {}
    for port in (tiny_services.draft_server.port, tiny_services.target_server.port):
        found.update(await asyncio.to_thread(discover_by_reflection, port))
    assert {"Propose", "Prefill", "Release", "Info"} <= found["specd.v1.DraftService"]
    assert {"Verify", "Decode", "Prefill", "Release", "Info"} <= found["specd.v1.TargetService"]


def discover_by_reflection(port: int) -> dict[str, set[str]]:
    found = {}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = descriptor_pool.DescriptorPool(database)
        for name in database.get_services():
            if name.startswith("specd.v1."):
                found[name] = {method.name for method in pool.FindServiceByName(name).methods}
    return found


async def test_info_describes_model_and_limits(tiny_services):
    info = await tiny_services.target.Info(common_pb2.InfoRequest())
    draft_info = await tiny_services.draft.Info(common_pb2.InfoRequest())
    assert info.role == "target" and draft_info.role == "draft"
    assert info.vocab_size == draft_info.vocab_size == 151_936
    assert info.tokenizer_fingerprint == draft_info.tokenizer_fingerprint
    assert info.dtype in ("float32", "gguf") and info.max_sessions == 8 and info.eos_token_ids


async def test_verify_accepts_all_some_or_none(tiny_services):
    greedy = await target_greedy(tiny_services, PROMPT, 6)
    committed = PROMPT
    for name, drafts, accepted in [
        ("all", greedy[:4], 4),
        ("some", greedy[:2] + [(greedy[2] + 1) % 1000, greedy[3]], 2),
        ("none", [(greedy[0] + 1) % 1000] + greedy[1:4], 0),
    ]:
        await prefill(tiny_services.target, name, committed[:-1])
        reply = await verify(tiny_services, name, committed, len(committed) - 1, drafts)
        assert reply.accepted == accepted, name
        assert list(reply.emitted_tokens) == greedy[: accepted + 1], name  # recovered or bonus = target's own
        # The rollback: KV for the committed prefix and the accepted drafts, none for the last emitted token.
        assert reply.cached_tokens == len(committed) + accepted, name


async def test_all_accepted_bonus_token_has_no_kv_and_the_next_step_continues_from_it(tiny_services):
    greedy = await target_greedy(tiny_services, PROMPT, 8)
    await prefill(tiny_services.target, "bonus", PROMPT[:-1])
    first = await verify(tiny_services, "bonus", PROMPT, len(PROMPT) - 1, greedy[:3])
    assert first.accepted == 3 and list(first.emitted_tokens) == greedy[:4]
    committed = PROMPT + greedy[:4]
    assert first.cached_tokens == len(committed) - 1  # the bonus token greedy[3] is not cached
    second = await verify(tiny_services, "bonus", committed, first.cached_tokens, greedy[4:7])
    assert list(second.emitted_tokens) == greedy[4:8]


async def test_same_call_twice_gives_same_answer_and_cache(tiny_services):
    greedy = await target_greedy(tiny_services, PROMPT, 4)
    await prefill(tiny_services.target, "retry", PROMPT[:-1])
    drafts = greedy[:1] + [7, 8]
    for request_sampling in (GREEDY, common_pb2.SamplingParams(temperature=0.8, seed=3)):
        answers = []
        for _ in range(2):  # e.g. a retry after a lost reply
            if request_sampling.temperature:
                proposal = await tiny_services.draft.Propose(
                    draft_pb2.ProposeRequest(
                        cursor=cursor("retry-d", PROMPT, 0), num_draft_tokens=3, sampling=request_sampling
                    )
                )
                reply = await verify(
                    tiny_services,
                    "retry",
                    PROMPT,
                    len(PROMPT) - 1,
                    list(proposal.draft_tokens),
                    q=proposal.q,
                    sampling=request_sampling,
                )
            else:
                reply = await verify(tiny_services, "retry", PROMPT, len(PROMPT) - 1, drafts)
            answers.append((reply.accepted, list(reply.emitted_tokens), reply.cached_tokens))
        assert answers[0] == answers[1]
        if not request_sampling.temperature:
            await tiny_services.draft.Prefill(common_pb2.PrefillRequest(cursor=cursor("retry-d", [], 0)))


async def test_stale_start_is_failed_precondition_saying_what_is_held(tiny_services):
    await prefill(tiny_services.target, "stale", PROMPT[:4])
    error = await expect_status(grpc.StatusCode.FAILED_PRECONDITION, verify(tiny_services, "stale", PROMPT, 6, [1, 2]))
    held = dict(error.trailing_metadata())[HELD_TOKENS_KEY]
    assert held == "4" and "holds 4 tokens" in error.details()
    # The caller resends from what the service holds and carries on.
    reply = await verify(tiny_services, "stale", PROMPT, 4, [1, 2])
    assert reply.cached_tokens >= len(PROMPT)


async def test_wrong_fingerprint_is_refused_and_leaves_the_session_intact(tiny_services):
    await prefill(tiny_services.target, "fp", PROMPT[:-1])
    bad = cursor("fp", PROMPT, len(PROMPT) - 1)
    bad.fingerprint ^= 1
    await expect_status(
        grpc.StatusCode.FAILED_PRECONDITION,
        tiny_services.target.Verify(target_pb2.VerifyRequest(cursor=bad, draft_tokens=[5])),
    )
    reply = await verify(tiny_services, "fp", PROMPT, len(PROMPT) - 1, [5])
    assert reply.cached_tokens in (len(PROMPT), len(PROMPT) + 1)


async def test_unknown_and_released_sessions_are_not_found(tiny_services):
    await expect_status(grpc.StatusCode.NOT_FOUND, verify(tiny_services, "nobody", PROMPT, 2, [1]))
    await prefill(tiny_services.draft, "gone", PROMPT)
    released = await tiny_services.draft.Release(common_pb2.ReleaseRequest(session_id="gone"))
    assert released.released
    await expect_status(
        grpc.StatusCode.NOT_FOUND,
        tiny_services.draft.Propose(
            draft_pb2.ProposeRequest(cursor=cursor("gone", PROMPT, len(PROMPT) - 1), num_draft_tokens=2)
        ),
    )


async def test_idle_sessions_are_evicted(tiny_loaded):
    services = await start_services(tiny_loaded["draft"], tiny_loaded["target"], Limits(idle_timeout_s=0.3))
    try:
        await prefill(services.target, "idle", PROMPT)
        await asyncio.sleep(1.0)
        info = await services.target.Info(common_pb2.InfoRequest())
        assert info.live_sessions == 0
        await expect_status(grpc.StatusCode.NOT_FOUND, verify(services, "idle", PROMPT, len(PROMPT) - 1, [1]))
    finally:
        await services.close()


async def test_full_service_is_resource_exhausted(tiny_loaded):
    services = await start_services(
        tiny_loaded["draft"], tiny_loaded["target"], Limits(max_sessions=2, max_cached_tokens=20)
    )
    try:
        await prefill(services.target, "a", PROMPT)
        await prefill(services.target, "b", PROMPT)
        await expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, prefill(services.target, "c", PROMPT))
        await services.target.Release(common_pb2.ReleaseRequest(session_id="b"))
        # Room for a session, but not for its tokens: 8 + 16 > 20 cached tokens.
        await expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, prefill(services.target, "c", PROMPT * 2))
        info = await services.target.Info(common_pb2.InfoRequest())
        assert info.live_sessions == 1 and info.cached_tokens == len(PROMPT)  # refusals left nothing behind
    finally:
        await services.close()


async def test_greedy_proposal_is_the_drafts_own_greedy_continuation(tiny_services):
    await prefill(tiny_services.draft, "p", PROMPT[:-1])
    reply = await tiny_services.draft.Propose(
        draft_pb2.ProposeRequest(cursor=cursor("p", PROMPT, len(PROMPT) - 1), num_draft_tokens=4)
    )
    assert len(reply.draft_tokens) == 4 and not reply.q
    assert reply.cached_tokens == len(PROMPT) + 3  # the last guess needs no KV
    # One at a time gives the same tokens: each K=1 proposal continues from the previous guess.
    committed = list(PROMPT)
    for _ in range(4):
        step = await tiny_services.draft.Propose(
            draft_pb2.ProposeRequest(cursor=cursor("p", committed, len(committed) - 1), num_draft_tokens=1)
        )
        committed += step.draft_tokens
    assert committed[len(PROMPT) :] == list(reply.draft_tokens)


async def test_sampled_proposal_returns_q_rows_it_sampled_from(tiny_services):
    sampling = common_pb2.SamplingParams(temperature=1.0, top_k=50, seed=11)
    await prefill(tiny_services.draft, "q", PROMPT[:-1])
    request = draft_pb2.ProposeRequest(
        cursor=cursor("q", PROMPT, len(PROMPT) - 1), num_draft_tokens=3, sampling=sampling
    )
    first, again = await tiny_services.draft.Propose(request), await tiny_services.draft.Propose(request)
    assert list(first.draft_tokens) == list(again.draft_tokens)
    assert len(first.q) == 3
    for token, row in zip(first.draft_tokens, first.q):
        probs = np.frombuffer(row.probs, dtype="<f4")
        assert len(row.token_ids) == len(probs) <= 50 and abs(probs.sum() - 1) < 1e-4
        assert token in row.token_ids
    # The target accepts or rejects them with the rule and always emits at least one token.
    await prefill(tiny_services.target, "q", PROMPT[:-1])
    reply = await verify(
        tiny_services, "q", PROMPT, len(PROMPT) - 1, list(first.draft_tokens), q=first.q, sampling=sampling
    )
    assert len(reply.emitted_tokens) == reply.accepted + 1


@pytest.mark.parametrize(
    "make_call, fragment",
    [
        (
            lambda s: s.draft.Propose(draft_pb2.ProposeRequest(cursor=cursor("bad", PROMPT, 7), num_draft_tokens=0)),
            "K=0",
        ),
        (
            lambda s: s.draft.Propose(draft_pb2.ProposeRequest(cursor=cursor("bad", PROMPT, 7), num_draft_tokens=99)),
            "K=99",
        ),
        (
            lambda s: s.draft.Propose(draft_pb2.ProposeRequest(cursor=cursor("bad", PROMPT, 8), num_draft_tokens=2)),
            "at least",
        ),
        (
            lambda s: s.target.Verify(target_pb2.VerifyRequest(cursor=cursor("bad", PROMPT, 7), draft_tokens=[10**6])),
            "vocabulary",
        ),
        (lambda s: s.target.Prefill(common_pb2.PrefillRequest(cursor=cursor("bad2", [151_936], 0))), "vocabulary"),
        (
            lambda s: s.target.Decode(
                target_pb2.DecodeRequest(
                    cursor=cursor("bad", PROMPT, 7), sampling=common_pb2.SamplingParams(temperature=-1)
                )
            ),
            "temperature",
        ),
        (
            lambda s: s.target.Decode(
                target_pb2.DecodeRequest(
                    cursor=cursor("bad", PROMPT, 7), sampling=common_pb2.SamplingParams(temperature=1, top_p=1.5)
                )
            ),
            "top_p",
        ),
        (
            lambda s: s.target.Verify(
                target_pb2.VerifyRequest(
                    cursor=cursor("bad", PROMPT, 7),
                    draft_tokens=[1, 2],
                    sampling=common_pb2.SamplingParams(temperature=1),
                )
            ),
            "q row",
        ),
        (lambda s: s.target.Prefill(common_pb2.PrefillRequest(cursor=cursor("", PROMPT, 0))), "session_id"),
    ],
)
async def test_bad_input_is_invalid_argument(tiny_services, make_call, fragment):
    await prefill(tiny_services.draft, "bad", PROMPT[:-1])
    await prefill(tiny_services.target, "bad", PROMPT[:-1])
    error = await expect_status(grpc.StatusCode.INVALID_ARGUMENT, make_call(tiny_services))
    assert fragment in error.details()
    info = await tiny_services.target.Info(common_pb2.InfoRequest())
    assert info.live_sessions == 1  # only "bad": a refused Prefill opened nothing


async def test_expired_deadline_is_deadline_exceeded(tiny_services):
    await prefill(tiny_services.target, "late", PROMPT[:-1])
    error = await expect_status(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        tiny_services.target.Decode(
            target_pb2.DecodeRequest(cursor=cursor("late", PROMPT, len(PROMPT) - 1)), timeout=1e-6
        ),
    )
    assert error is not None


async def test_a_call_from_token_0_opens_the_session_and_equals_prefill_then_the_call(tiny_services):
    """No Prefill needed: a Decode or Propose whose cursor starts at 0 is the session's prefill, and
    gives what a Prefill of all but the last token and the call from there give."""
    reference = await target_greedy(tiny_services, PROMPT, 3, session="prefilled")
    committed = list(PROMPT)
    for step in range(3):
        start = 0 if step == 0 else len(committed) - 1
        request = target_pb2.DecodeRequest(cursor=cursor("opened-by-decode", committed, start))
        reply = await tiny_services.target.Decode(request)
        assert reply.cached_tokens == len(committed)
        committed += list(reply.emitted_tokens)
    assert committed[len(PROMPT) :] == reference
    proposal = await tiny_services.draft.Propose(
        draft_pb2.ProposeRequest(cursor=cursor("opened-by-propose", PROMPT, 0), num_draft_tokens=3)
    )
    assert proposal.cached_tokens == len(PROMPT) + 2 and len(proposal.draft_tokens) == 3
    info = await tiny_services.target.Info(common_pb2.InfoRequest())
    assert info.live_sessions >= 1
    for stub, session in ((tiny_services.target, "opened-by-decode"), (tiny_services.draft, "opened-by-propose")):
        assert (await stub.Release(common_pb2.ReleaseRequest(session_id=session))).released
