"""Bad input on every public RPC, one table: the right status code, a message a user can act on,
a server that stays healthy, and nothing left behind (docs/architecture.md §5)."""

from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.proto.contract import fingerprint
from specd.v1 import common_pb2, draft_pb2, specdecode_pb2, target_pb2

PROMPT = [785, 8251, 7640, 389, 279, 5837, 13, 576]
SESSION = "bad-input"  # prefilled on both services (PROMPT minus its last token) before each case
VOCAB = 151_936
Code = grpc.StatusCode


def cursor(
    committed=PROMPT, start: int = len(PROMPT) - 1, session: str = SESSION, **fields
) -> common_pb2.SessionCursor:
    message = common_pb2.SessionCursor(
        session_id=session, start=start, fingerprint=fingerprint(committed[:start]), tokens=committed[start:]
    )
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def sampling(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)


def q_row(token_ids, probs: bytes) -> draft_pb2.SparseDistribution:
    return draft_pb2.SparseDistribution(token_ids=token_ids, probs=probs)


def f32(*values: float) -> bytes:
    import numpy as np

    return np.array(values, dtype="<f4").tobytes()


def length_delimited(field: int, payload: bytes) -> bytes:
    """One protobuf field of wire type 2 (string, bytes, message); payloads < 128 bytes."""
    return bytes([field << 3 | 2, len(payload)]) + payload


NOT_UTF8 = b"\xff\xfe"
# U+D800 as UTF-8 would spell it: a lone surrogate, which the HTTP API refuses too. A proto string
# is UTF-8, so gRPC cannot carry one (Python's protobuf will not even set it: UnicodeEncodeError).
LONE_SURROGATE = b"\xed\xa0\x80"


@dataclass
class Case:
    name: str
    server: str  # "orchestrator", "draft" or "target"
    method: str
    request: object  # a message, or raw bytes sent as they are
    code: grpc.StatusCode
    says: str  # a fragment of the message that tells the user what to fix


G = specdecode_pb2.GenerateRequest
# A table, one case to a line or two: the formatter leaves it as laid out.
# fmt: off
CASES = [
    # -- specd.v1.SpecDecode/Generate: the client's request -------------------------------------
    Case("empty prompt", "orchestrator", "Generate", G(prompt="", max_new_tokens=4),
         Code.INVALID_ARGUMENT, "prompt is empty"),
    Case("prompt longer than a session", "orchestrator", "Generate", G(prompt_token_ids=[13] * 5000, max_new_tokens=4),
         Code.INVALID_ARGUMENT, "shorten the prompt"),
    Case("max_new_tokens 0", "orchestrator", "Generate", G(prompt="hi", max_new_tokens=0),
         Code.INVALID_ARGUMENT, "max_new_tokens must be at least 1"),
    Case("huge max_new_tokens", "orchestrator", "Generate", G(prompt="hi", max_new_tokens=2**32 - 1),
         Code.INVALID_ARGUMENT, "ask for fewer tokens"),
    Case("K above the services' limit", "orchestrator", "Generate", G(prompt="hi", max_new_tokens=4, draft_tokens=99),
         Code.INVALID_ARGUMENT, "K=99"),
    Case("negative temperature", "orchestrator", "Generate",
         G(prompt="hi", max_new_tokens=4, sampling=sampling(temperature=-1)), Code.INVALID_ARGUMENT, "temperature"),
    Case("NaN temperature", "orchestrator", "Generate",
         G(prompt="hi", max_new_tokens=4, sampling=sampling(temperature=float("nan"))),
         Code.INVALID_ARGUMENT, "temperature"),
    Case("top_p above 1", "orchestrator", "Generate",
         G(prompt="hi", max_new_tokens=4, sampling=sampling(temperature=1, top_p=1.5)), Code.INVALID_ARGUMENT, "top_p"),
    Case("out-of-vocabulary prompt id", "orchestrator", "Generate", G(prompt_token_ids=[1, VOCAB], max_new_tokens=4),
         Code.INVALID_ARGUMENT, "outside the vocabulary"),
    Case("stop string not UTF-8", "orchestrator", "Generate",
         G(prompt="hi", max_new_tokens=4).SerializeToString() + length_delimited(5, NOT_UTF8),
         Code.INVALID_ARGUMENT, "UTF-8"),
    Case("prompt holding a lone surrogate", "orchestrator", "Generate",
         G(max_new_tokens=4).SerializeToString() + length_delimited(1, LONE_SURROGATE),
         Code.INVALID_ARGUMENT, "UTF-8"),
    Case("garbage bytes", "orchestrator", "Generate", b"\x0a\xff\xff\xff",
         Code.INVALID_ARGUMENT, "not a valid message for /specd.v1.SpecDecode/Generate"),
    Case("message over 4 MiB", "orchestrator", "Generate", G(prompt="x" * (5 << 20), max_new_tokens=4),
         Code.RESOURCE_EXHAUSTED, "larger than max"),
    Case("truncated Info request", "orchestrator", "Info", b"\x08", Code.INVALID_ARGUMENT, "not a valid message"),
    Case("cache_salt over 256 characters", "orchestrator", "Generate",
         G(prompt="hi", max_new_tokens=4, cache_salt="s" * 257),
         Code.INVALID_ARGUMENT, "cache_salt must be at most 256"),
    # -- specd.v1.DraftService ---------------------------------------------------------------------
    Case("Propose K=0", "draft", "Propose", draft_pb2.ProposeRequest(cursor=cursor(), num_draft_tokens=0),
         Code.INVALID_ARGUMENT, "K=0 is outside 1..16"),
    Case("Propose K above max_draft_tokens", "draft", "Propose",
         draft_pb2.ProposeRequest(cursor=cursor(), num_draft_tokens=17),
         Code.INVALID_ARGUMENT, "K=17 is outside 1..16"),
    Case("Propose unknown session", "draft", "Propose",
         draft_pb2.ProposeRequest(cursor=cursor(session="nobody"), num_draft_tokens=2), Code.NOT_FOUND, "Prefill it"),
    Case("Propose wrong fingerprint", "draft", "Propose",
         draft_pb2.ProposeRequest(cursor=cursor(fingerprint=12345), num_draft_tokens=2),
         Code.FAILED_PRECONDITION, "fingerprint of the first 7 tokens differs; the session holds 7 tokens"),
    Case("Propose with nothing after start", "draft", "Propose",
         draft_pb2.ProposeRequest(cursor=cursor(start=len(PROMPT)), num_draft_tokens=2),
         Code.INVALID_ARGUMENT, "at least the last committed token"),
    Case("Propose start beyond what is held", "draft", "Propose",
         draft_pb2.ProposeRequest(cursor=cursor(PROMPT * 2, start=12), num_draft_tokens=2),
         Code.FAILED_PRECONDITION, "start 12 is past the cached tokens"),
    Case("Propose NaN temperature", "draft", "Propose",
         draft_pb2.ProposeRequest(cursor=cursor(), num_draft_tokens=2, sampling=sampling(temperature=float("nan"))),
         Code.INVALID_ARGUMENT, "temperature must be a finite number"),
    Case("Propose top_p above 1", "draft", "Propose",
         draft_pb2.ProposeRequest(cursor=cursor(), num_draft_tokens=2, sampling=sampling(temperature=1, top_p=2)),
         Code.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    Case("Propose q rows over --max-q-bytes", "draft", "Propose",
         draft_pb2.ProposeRequest(cursor=cursor(), num_draft_tokens=16, sampling=sampling(temperature=1)),
         Code.INVALID_ARGUMENT, "over this draft's limit of 4,194,304 bytes (--max-q-bytes); ask for K <= 4"),
    Case("Prefill out-of-vocabulary id", "draft", "Prefill",
         common_pb2.PrefillRequest(cursor=cursor([1, 2, VOCAB + 7], start=0, session="oov")),
         Code.INVALID_ARGUMENT, f"id {VOCAB + 7}, outside the vocabulary"),
    Case("Prefill empty session id", "draft", "Prefill", common_pb2.PrefillRequest(cursor=cursor(start=0, session="")),
         Code.INVALID_ARGUMENT, "session_id must be 1..128"),
    Case("Prefill 129-character session id", "draft", "Prefill",
         common_pb2.PrefillRequest(cursor=cursor(start=0, session="s" * 129)),
         Code.INVALID_ARGUMENT, "1..128 characters"),
    Case("Prefill a new session from start > 0", "draft", "Prefill",
         common_pb2.PrefillRequest(cursor=cursor(start=3, session="fresh")), Code.FAILED_PRECONDITION, "is new"),
    Case("Prefill longer than a session", "draft", "Prefill",
         common_pb2.PrefillRequest(cursor=cursor([13] * 5000, start=0, session="long")),
         Code.INVALID_ARGUMENT, "the limit is 4096"),
    Case("Prefill cache_salt over 256 characters", "draft", "Prefill",
         common_pb2.PrefillRequest(cursor=cursor(start=0, session="salty", cache_salt="s" * 257)),
         Code.INVALID_ARGUMENT, "cache_salt must be at most 256 characters, got 257"),
    Case("Propose cache_salt over 256 characters", "draft", "Propose",
         draft_pb2.ProposeRequest(cursor=cursor(cache_salt="s" * 300), num_draft_tokens=2),
         Code.INVALID_ARGUMENT, "cache_salt must be at most 256"),
    Case("session id not UTF-8", "draft", "Prefill", length_delimited(1, length_delimited(1, NOT_UTF8)),
         Code.INVALID_ARGUMENT, "UTF-8"),
    Case("Release unknown session is fine", "draft", "Release", common_pb2.ReleaseRequest(session_id="nobody"),
         Code.OK, ""),
    Case("Release committed out-of-vocabulary id", "draft", "Release",
         common_pb2.ReleaseRequest(session_id="nobody", committed=[1, VOCAB + 3]),
         Code.INVALID_ARGUMENT, f"committed tokens contain id {VOCAB + 3}, outside the vocabulary"),
    Case("Prefill session id with a NUL", "draft", "Prefill",
         common_pb2.PrefillRequest(cursor=cursor(start=0, session="\0answer")),
         Code.INVALID_ARGUMENT, "none of them NUL"),
    # -- specd.v1.TargetService --------------------------------------------------------------------
    Case("Verify out-of-vocabulary draft token", "target", "Verify",
         target_pb2.VerifyRequest(cursor=cursor(), draft_tokens=[5, 10**6]),
         Code.INVALID_ARGUMENT, "outside the vocabulary"),
    Case("Verify more drafts than max_draft_tokens", "target", "Verify",
         target_pb2.VerifyRequest(cursor=cursor(), draft_tokens=[5] * 17), Code.INVALID_ARGUMENT, "K=17"),
    Case("Verify sampled without q rows", "target", "Verify",
         target_pb2.VerifyRequest(cursor=cursor(), draft_tokens=[5, 6], sampling=sampling(temperature=1)),
         Code.INVALID_ARGUMENT, "one q row per draft token"),
    Case(
        "Verify q probs not float32",
        "target",
        "Verify",
        target_pb2.VerifyRequest(
            cursor=cursor(), draft_tokens=[5], q=[q_row([5], b"\x00\x00\x80")], sampling=sampling(temperature=1)
        ),
        Code.INVALID_ARGUMENT,
        "little-endian float32",
    ),
    Case(
        "Verify q with NaN",
        "target",
        "Verify",
        target_pb2.VerifyRequest(
            cursor=cursor(), draft_tokens=[5], q=[q_row([5], f32(float("nan")))], sampling=sampling(temperature=1)
        ),
        Code.INVALID_ARGUMENT,
        "finite, non-negative",
    ),
    Case(
        "Verify q id outside the vocabulary",
        "target",
        "Verify",
        target_pb2.VerifyRequest(
            cursor=cursor(), draft_tokens=[5], q=[q_row([5, VOCAB], f32(0.5, 0.5))], sampling=sampling(temperature=1)
        ),
        Code.INVALID_ARGUMENT,
        "in-vocabulary ids",
    ),
    Case(
        "Verify draft token with q = 0",
        "target",
        "Verify",
        target_pb2.VerifyRequest(
            cursor=cursor(), draft_tokens=[5], q=[q_row([6], f32(1.0))], sampling=sampling(temperature=1)
        ),
        Code.INVALID_ARGUMENT,
        "q > 0",
    ),
    Case(
        "Verify ids and probs of different lengths",
        "target",
        "Verify",
        target_pb2.VerifyRequest(
            cursor=cursor(), draft_tokens=[5], q=[q_row([5, 6], f32(1.0))], sampling=sampling(temperature=1)
        ),
        Code.INVALID_ARGUMENT,
        "as many probabilities",
    ),
    Case("Decode unknown session", "target", "Decode", target_pb2.DecodeRequest(cursor=cursor(session="nobody")),
         Code.NOT_FOUND, "no session 'nobody'"),
    Case("Decode wrong fingerprint", "target", "Decode", target_pb2.DecodeRequest(cursor=cursor(fingerprint=1)),
         Code.FAILED_PRECONDITION, "resend from there or from 0"),
    Case("Decode negative temperature", "target", "Decode",
         target_pb2.DecodeRequest(cursor=cursor(), sampling=sampling(temperature=-0.5)),
         Code.INVALID_ARGUMENT, "temperature must be a finite number >= 0"),
    Case("Decode empty cursor", "target", "Decode", target_pb2.DecodeRequest(cursor=cursor(start=len(PROMPT))),
         Code.INVALID_ARGUMENT, "at least the last committed token"),
    Case("Verify cache_salt over 256 characters", "target", "Verify",
         target_pb2.VerifyRequest(cursor=cursor(cache_salt="s" * 257), draft_tokens=[5]),
         Code.INVALID_ARGUMENT, "cache_salt must be at most 256"),
    Case("Decode cache_salt over 256 characters", "target", "Decode",
         target_pb2.DecodeRequest(cursor=cursor(start=0, session="salty", cache_salt="s" * 257)),
         Code.INVALID_ARGUMENT, "cache_salt must be at most 256"),
    Case("Prefill cache_salt over 256 characters", "target", "Prefill",
         common_pb2.PrefillRequest(cursor=cursor(start=0, session="salty", cache_salt="s" * 257)),
         Code.INVALID_ARGUMENT, "cache_salt must be at most 256"),
    Case("Prefill start 2^32-1", "target", "Prefill", common_pb2.PrefillRequest(cursor=cursor(start=2**32 - 1)),
         Code.FAILED_PRECONDITION, "past the cached tokens"),
    Case("truncated Verify bytes", "target", "Verify", b"\x0a\x05\x0a",
         Code.INVALID_ARGUMENT, "not a valid message for /specd.v1.TargetService/Verify"),
]
# fmt: on

SERVICE = {"orchestrator": "specd.v1.SpecDecode", "draft": "specd.v1.DraftService", "target": "specd.v1.TargetService"}


def channels(stack) -> dict[str, grpc.aio.Channel]:
    return {
        "orchestrator": stack.channel,
        "draft": stack.services.draft_channel,
        "target": stack.services.target_channel,
    }


async def call(stack, case: Case):
    """Send the case's request as bytes (so malformed ones go out unchanged); drain a stream."""
    channel = channels(stack)[case.server]
    method = f"/{SERVICE[case.server]}/{case.method}"
    payload = case.request if isinstance(case.request, bytes) else case.request.SerializeToString()
    if case.method == "Generate":
        return [reply async for reply in channel.unary_stream(method)(payload, timeout=60)]
    return await channel.unary_unary(method)(payload, timeout=60)


@pytest.fixture
async def prefilled(tiny_stack):
    services = tiny_stack.services
    request = common_pb2.PrefillRequest(cursor=cursor(start=0, committed=PROMPT[:-1]))
    await services.draft.Prefill(request)
    await services.target.Prefill(request)
    yield tiny_stack
    for stub in (services.draft, services.target):
        await stub.Release(common_pb2.ReleaseRequest(session_id=SESSION))


def test_the_table_has_enough_cases_and_covers_every_public_rpc():
    assert len(CASES) >= 20
    covered = {(case.server, case.method) for case in CASES}
    assert {
        ("orchestrator", "Generate"),
        ("draft", "Prefill"),
        ("draft", "Propose"),
        ("draft", "Release"),
        ("target", "Prefill"),
        ("target", "Verify"),
        ("target", "Decode"),
    } <= covered


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_bad_input_gets_its_status_and_an_actionable_message(prefilled, case):
    stack = prefilled
    if case.code == Code.OK:
        await call(stack, case)
    else:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(stack, case)
        assert caught.value.code() == case.code, caught.value.details()
        assert case.says in caught.value.details()
    # Nothing leaks: only the prefilled session lives on each service.
    assert await stack.live_sessions() == (1, 1)


async def test_after_all_that_every_server_is_healthy_and_serves(tiny_stack):
    for channel in channels(tiny_stack).values():
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    replies = [
        reply async for reply in tiny_stack.client.Generate(G(prompt="def f(x):", max_new_tokens=6, ignore_eos=True))
    ]
    assert replies[-1].final.usage.completion_tokens == 6
    assert await tiny_stack.live_sessions() == (0, 0)
