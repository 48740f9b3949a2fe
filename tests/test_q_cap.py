"""The cap on the draft's q rows (--max-q-bytes, proto/limits.py): a sampled Propose whose K rows
could pass it is refused INVALID_ARGUMENT before anything runs, one within it answers rows within
it, and the orchestrator asks for a K that fits, so a request never meets the refusal."""

import random

import grpc
import pytest
from conftest import start_services

from specd.draft_service import drafter as drafter_module
from specd.draft_service.drafter import Drafter, ProposeCall
from specd.model.sampling import Sampling
from specd.model.sessions import Cursor
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.core import Core
from specd.orchestrator.remote import ServicePair
from specd.proto.contract import fingerprint
from specd.proto.limits import MAX_Q_BYTES, Limits, q_bytes, q_draft_tokens, q_row_bytes
from specd.v1 import common_pb2, draft_pb2, specdecode_pb2

PROMPT = [785, 8251, 7640, 389, 279, 5837, 13, 576]
VOCAB = 151_936
CAP = Limits().max_q_bytes  # 4 MiB
SAMPLED = common_pb2.SamplingParams(temperature=1.0, seed=5)  # no top_k: rows over the whole vocabulary


def cursor(session: str, committed: list[int], start: int) -> common_pb2.SessionCursor:
    return common_pb2.SessionCursor(
        session_id=session, start=start, fingerprint=fingerprint(committed[:start]), tokens=committed[start:]
    )


def propose(session: str, k: int, sampling: common_pb2.SamplingParams, start: int = len(PROMPT) - 1):
    return draft_pb2.ProposeRequest(cursor=cursor(session, PROMPT, start), num_draft_tokens=k, sampling=sampling)


async def prefill(stub, session: str) -> None:
    await stub.Prefill(common_pb2.PrefillRequest(cursor=cursor(session, PROMPT[:-1], 0)))


def test_q_row_bytes_is_the_encoded_size_of_the_largest_row():
    for entries in (1, 127, 128, 5_000, 16_384, VOCAB):
        row = draft_pb2.SparseDistribution(token_ids=range(VOCAB - entries, VOCAB), probs=bytes(4 * entries))
        assert draft_pb2.ProposeResponse(q=[row]).ByteSize() == q_row_bytes(entries, VOCAB)
    chosen = random.Random(3)
    for entries in (1, 50, 3_000):
        row = draft_pb2.SparseDistribution(
            token_ids=sorted(chosen.sample(range(VOCAB), entries)), probs=bytes(4 * entries)
        )
        assert draft_pb2.ProposeResponse(q=[row]).ByteSize() <= q_row_bytes(entries, VOCAB)
    # Today's worst case without the cap: 16 rows over the whole vocabulary, 16.75 MB in one reply.
    assert q_bytes(16, 0, VOCAB) == 16 * 1_047_052
    assert q_draft_tokens(CAP, 0, VOCAB) == 4 and q_draft_tokens(CAP, 10**6, VOCAB) == 4
    assert q_draft_tokens(CAP, 50, VOCAB) > 16  # a usual top_k never binds


async def test_propose_over_the_cap_is_refused_before_it_runs(tiny_services, monkeypatch):
    draft = tiny_services.draft
    service = tiny_services.draft_server.thread.service
    passes = []
    forward = service.engine.forward
    monkeypatch.setattr(service.engine, "forward", lambda rows: passes.append(rows) or forward(rows))
    await prefill(draft, "capped")
    before = await draft.Info(common_pb2.InfoRequest())
    passes.clear()
    for k, sampling, says in (
        (5, SAMPLED, "top_k=0 (off)"),
        (16, common_pb2.SamplingParams(temperature=0.7, top_k=10**6), "top_k=1,000,000 (the whole vocabulary)"),
    ):
        for request in (propose("capped", k, sampling), propose("new", k, sampling, start=0)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await draft.Propose(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = refused.value.details()
            assert f"K={k}" in details and says in details and f"{q_bytes(k, 0, VOCAB):,} bytes" in details
            assert f"limit of {CAP:,} bytes (--max-q-bytes)" in details and "ask for K <= 4" in details
    assert not passes  # nothing ran for the refused calls
    after = await draft.Info(common_pb2.InfoRequest())
    assert (after.live_sessions, after.cached_tokens) == (before.live_sessions, before.cached_tokens)
    # The session is as it was: a valid Propose on it guesses what one on a fresh session does.
    small = common_pb2.SamplingParams(temperature=1.0, top_k=50, seed=9)
    again = await draft.Propose(propose("capped", 3, small))
    await prefill(draft, "fresh")
    fresh = await draft.Propose(propose("fresh", 3, small))
    assert list(again.draft_tokens) == list(fresh.draft_tokens) and len(again.draft_tokens) == 3
    assert again.cached_tokens == fresh.cached_tokens == len(PROMPT) + 2
    assert [list(row.token_ids) for row in again.q] == [list(row.token_ids) for row in fresh.q]


async def test_propose_within_the_cap_answers_rows_within_it(tiny_services):
    await prefill(tiny_services.draft, "within")
    reply = await tiny_services.draft.Propose(propose("within", 4, SAMPLED))
    assert len(reply.draft_tokens) == len(reply.q) == 4
    assert min(len(row.token_ids) for row in reply.q) > 100_000  # a tiny random model's q is nearly flat
    assert draft_pb2.ProposeResponse(q=reply.q).ByteSize() <= CAP
    assert reply.ByteSize() < 4 * 1024 * 1024  # even gRPC's default message limit takes it


async def test_info_reports_the_cap(tiny_services, tiny_loaded):
    draft = await tiny_services.draft.Info(common_pb2.InfoRequest())
    target = await tiny_services.target.Info(common_pb2.InfoRequest())
    assert draft.max_q_bytes == CAP and target.max_q_bytes == 0  # the target sends no q rows
    services = await start_services(tiny_loaded["draft"], tiny_loaded["target"], Limits(max_q_bytes=12_345))
    try:
        assert (await services.draft.Info(common_pb2.InfoRequest())).max_q_bytes == 12_345
    finally:
        await services.close()


def test_max_q_bytes_is_a_draft_serve_setting():
    from specd.cli import build_parser
    from specd.cli.serve import limits_from_args

    parse = build_parser().parse_args
    assert limits_from_args(parse(["serve", "draft", "--max-q-bytes", "1000000"])).max_q_bytes == 1_000_000
    assert limits_from_args(parse(["serve", "draft"])).max_q_bytes == CAP
    for bad in (["serve", "draft", "--max-q-bytes", "0"], ["serve", "draft", "--max-q-bytes", str(MAX_Q_BYTES + 1)]):
        with pytest.raises(SystemExit):
            parse(bad)
    with pytest.raises(SystemExit):  # a target sends no q rows
        parse(["serve", "target", "--max-q-bytes", "1000"])


def test_a_row_past_top_k_cuts_the_draft_short(tiny_loaded, monkeypatch):
    """Logits tied at the k-th largest keep more than top_k entries: the call answers the guesses
    whose rows fit (a smaller K), and its session holds exactly those."""
    limit = 2 * q_row_bytes(50, VOCAB)  # K=2 at top_k=50 fits
    drafter = Drafter(TransformersEngine(tiny_loaded["draft"]), Limits(max_q_bytes=limit))
    real = drafter_module.probs_from_logits
    wider = lambda logits, sampling: real(logits, Sampling(sampling.temperature, top_k=60))  # noqa: E731
    monkeypatch.setattr(drafter_module, "probs_from_logits", wider)
    drafter.prefill(Cursor("tied", 0, 0, PROMPT[:-1]))
    start = len(PROMPT) - 1
    call = ProposeCall(Cursor("tied", start, fingerprint(PROMPT[:start]), PROMPT[start:]), 2, Sampling(1.0, top_k=50))
    proposal = drafter.propose(call)
    assert len(proposal.draft_tokens) == len(proposal.q) == 1 and len(proposal.q[0][0]) == 60
    assert proposal.q_bytes == q_row_bytes(60, VOCAB) <= limit
    assert drafter.store.sessions["tied"].tokens == PROMPT + proposal.draft_tokens
    assert proposal.cached_tokens == len(PROMPT) + 1


def info(role: str, max_q_bytes: int = 0) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        role=role, vocab_size=VOCAB, max_session_tokens=4096, max_draft_tokens=16, max_q_bytes=max_q_bytes
    )


@pytest.mark.parametrize(
    "sampling, asked, fixed_k, adaptive_max_k",
    [
        (common_pb2.SamplingParams(temperature=0.8), 8, 4, 4),  # no top_k: 4 rows over the vocabulary fit
        (common_pb2.SamplingParams(temperature=0.8, top_k=10**6), 3, 3, 4),  # under the cap already
        (common_pb2.SamplingParams(temperature=0.8, top_k=50), 8, 8, 8),  # a usual top_k: no bound
        (common_pb2.SamplingParams(), 8, 8, 8),  # greedy: no q rows
    ],
)
def test_the_orchestrator_asks_for_no_more_k_than_the_q_rows_fit(sampling, asked, fixed_k, adaptive_max_k):
    core = Core(ServicePair(None, None, info("draft", CAP), info("target"), None, ()), pool=None)
    message = specdecode_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=8, sampling=sampling)
    adaptive = core.prepare(message, None)
    assert adaptive.draft_tokens is None and adaptive.max_draft_tokens == adaptive_max_k
    message.draft_tokens = asked
    assert core.prepare(message, None).draft_tokens == fixed_k
    unreported = Core(ServicePair(None, None, info("draft"), info("target"), None, ()), pool=None)
    assert unreported.prepare(message, None).draft_tokens == asked  # a draft that states no cap: none applied


async def generate(client, message) -> tuple[list[int], specdecode_pb2.Final]:
    tokens, final = [], None
    async for reply in client.Generate(message):
        tokens += reply.delta.token_ids
        if reply.HasField("final"):
            final = reply.final
    return tokens, final


async def test_a_sampled_request_with_a_huge_top_k_runs_at_a_k_that_fits(tiny_stack):
    sampling = common_pb2.SamplingParams(temperature=1.0, top_k=10**6, seed=3)
    fits = q_draft_tokens(CAP, sampling.top_k, VOCAB)
    for draft_tokens in (8, None):  # fixed, and adaptive (the orchestrator's --max-draft-tokens is 8)
        message = specdecode_pb2.GenerateRequest(
            prompt="def quicksort(arr):", max_new_tokens=12, sampling=sampling, ignore_eos=True
        )
        if draft_tokens is not None:
            message.draft_tokens = draft_tokens
        tokens, final = await generate(tiny_stack.client, message)
        assert len(tokens) == 12 and final.finish_reason == "length"
        assert final.stats.draft_tokens == fits and max(final.stats.draft_lengths) <= fits
        if draft_tokens is not None:
            assert final.stats.drafted > 0  # it speculated: no Propose was refused (a refusal runs target-only)
