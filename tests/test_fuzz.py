"""Property-based fuzzing of the service messages (hypothesis, 1,000 cases per service) and of
the OpenAI-compatible HTTP API's bodies (60 per endpoint).

Each service case is one to three calls, well-formed or not: cursors that are right or wrong about
what a session holds, ids inside and outside the vocabulary, any float32 sampling setting, q rows
of any shape, raw bytes. Whatever comes in: no INTERNAL or UNKNOWN, the server keeps serving,
and the live sessions are exactly those a successful Prefill opened and no Release closed.

Each HTTP case is one body: an object whose fields are mostly well-formed (so many generate) and
some anything at all (nested nulls, huge numbers, lone surrogates), or any JSON value, or bytes.
Whatever comes in: no 5xx, an OpenAI-style error or a whole answer, and no session left behind.
"""

import json

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_openai_api import http, sessions_released

from specd.proto.contract import fingerprint
from specd.v1 import common_pb2, draft_pb2, target_pb2

VOCAB = 151_936
SESSIONS = ["fz-a", "fz-b", "fz-c"]
BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(
    max_examples=1000, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)

# About half of each kind of field is well-formed, so many calls get past validation to the model.
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8) | st.lists(st.integers(0, 2**32 - 1), max_size=10)
floats32 = st.floats(width=32)  # NaN and infinities included
samplings = st.builds(common_pb2.SamplingParams) | st.builds(
    common_pb2.SamplingParams,
    temperature=st.floats(0, 4, width=32) | floats32,
    top_p=st.just(0.0) | st.floats(0, 1, width=32) | floats32,
    top_k=st.integers(0, 100) | st.integers(0, 2**32 - 1),
    seed=st.integers(0, 2**64 - 1),
)
q_rows = st.lists(
    st.builds(
        draft_pb2.SparseDistribution,
        token_ids=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 20), max_size=6),
        probs=st.lists(floats32, max_size=6).map(lambda values: np.array(values, dtype="<f4").tobytes())
        | st.binary(max_size=24),
    ),
    max_size=5,
)


class Tracker:
    """What we believe each session holds, so many cursors are right and reach the model."""

    def __init__(self):
        self.held: dict[str, list[int]] = {}
        # Sessions a failed call from token 0 may have opened: it ran, then its reply was lost
        # (say, over the client's message limit). Released after each example, as the orchestrator does.
        self.uncertain: set[str] = set()

    def cursor(self, data) -> common_pb2.SessionCursor:
        session = data.draw(st.sampled_from(SESSIONS * 4 + ["", "x" * 129]) | st.text(max_size=6))
        # Draws never depend on the state (hypothesis replays them); only their reading does.
        held = self.held.get(session, [])
        start = data.draw(st.integers(0, 16) | st.integers(0, 2**32 - 1))
        if data.draw(st.sampled_from([True, True, True, False])):
            start = min(start, len(held))  # within what the session holds
        print_ = data.draw(st.sampled_from([None, None, None, 0]))
        if print_ is None:
            print_ = fingerprint(held[:start])  # the right one
        else:
            print_ = data.draw(st.integers(0, 2**64 - 1))
        return common_pb2.SessionCursor(session_id=session, start=start, fingerprint=print_, tokens=data.draw(tokens))

    def answered(self, cursor: common_pb2.SessionCursor, extra: list[int], cached: int) -> None:
        believed = self.held.get(cursor.session_id, [])[: cursor.start]
        self.held[cursor.session_id] = (believed + list(cursor.tokens) + extra)[:cached]


RAW_REQUESTS = {
    "Prefill": common_pb2.PrefillRequest,
    "Propose": draft_pb2.ProposeRequest,
    "Verify": target_pb2.VerifyRequest,
    "Decode": target_pb2.DecodeRequest,
}


async def send(stub, method: str, request):
    """(status code, reply) of one call."""
    try:
        reply = await getattr(stub, method)(request, timeout=30)
        event(f"{method} OK")  # --hypothesis-show-statistics: how many calls reached the model
        return grpc.StatusCode.OK, reply
    except grpc.aio.AioRpcError as error:
        assert error.code() not in BUGS, f"{method}: {error.code().name}: {error.details()}"
        event(f"{method} {error.code().name}")
        return error.code(), None


async def send_raw(channel, service: str, method: str, payload: bytes):
    try:
        await channel.unary_unary(f"/{service}/{method}")(payload, timeout=30)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as error:
        assert error.code() not in BUGS, f"raw {method}: {error.code().name}: {error.details()}"
        return error.code()


async def one_call(data, stub, channel, service: str, tracker: Tracker, live: set[str], session_methods) -> None:
    kind = data.draw(st.sampled_from(["Prefill", "Release", "raw", *session_methods * 3]))
    if kind == "raw":
        method = data.draw(st.sampled_from(["Prefill", "Release", "Info", *session_methods]))
        payload = data.draw(st.binary(max_size=48))
        code = await send_raw(channel, service, method, payload)
        if code == grpc.StatusCode.OK and method == "Release":
            live.discard(common_pb2.ReleaseRequest.FromString(payload).session_id)
        elif method != "Info" and code in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED):
            session_id = RAW_REQUESTS[method].FromString(payload).cursor.session_id
            if code == grpc.StatusCode.OK:  # a call from token 0 opens its session
                live.add(session_id)
                tracker.held.pop(session_id, None)  # unknown contents now: refresh via FAILED_PRECONDITION
            else:
                tracker.uncertain.add(session_id)
        return
    if kind == "Release":
        session = data.draw(st.sampled_from(SESSIONS) | st.text(max_size=4))
        code, _ = await send(stub, "Release", common_pb2.ReleaseRequest(session_id=session))
        assert code == grpc.StatusCode.OK  # releasing anything, even unknown, is fine
        live.discard(session)
        tracker.held.pop(session, None)
        return
    cursor = tracker.cursor(data)
    if kind == "Prefill":
        code, reply = await send(stub, "Prefill", common_pb2.PrefillRequest(cursor=cursor))
        if reply is not None:
            live.add(cursor.session_id)
            tracker.answered(cursor, [], reply.cached_tokens)
    elif kind == "Propose":
        request = draft_pb2.ProposeRequest(
            cursor=cursor,
            num_draft_tokens=data.draw(st.integers(1, 8) | st.integers(0, 20)),
            sampling=data.draw(samplings),
        )
        code, reply = await send(stub, "Propose", request)
        if reply is None and cursor.start == 0:
            tracker.uncertain.add(cursor.session_id)
        if reply is not None:
            assert len(reply.draft_tokens) == request.num_draft_tokens
            assert all(token < VOCAB for token in reply.draft_tokens)
            live.add(cursor.session_id)  # opened by this call if it started at token 0
            tracker.answered(cursor, list(reply.draft_tokens), reply.cached_tokens)
    else:  # Verify or Decode
        sampling = data.draw(samplings)
        if kind == "Verify":
            drafts = data.draw(tokens)
            one_hot = [
                draft_pb2.SparseDistribution(token_ids=[token], probs=np.float32(1).tobytes()) for token in drafts
            ]
            q = data.draw(st.just(one_hot) | q_rows)  # one-hot rows are valid q for any drafts
            request = target_pb2.VerifyRequest(
                cursor=cursor, draft_tokens=drafts, q=q, sampling=sampling, return_logprobs=data.draw(st.booleans())
            )
        else:
            request = target_pb2.DecodeRequest(cursor=cursor, sampling=sampling)
        code, reply = await send(stub, kind, request)
        if reply is None and cursor.start == 0:
            tracker.uncertain.add(cursor.session_id)
        if reply is not None:
            drafts = list(getattr(request, "draft_tokens", []))
            assert reply.accepted <= len(drafts) and len(reply.emitted_tokens) == reply.accepted + 1
            assert all(token < VOCAB for token in reply.emitted_tokens)
            live.add(cursor.session_id)  # opened by this call if it started at token 0
            tracker.answered(cursor, drafts[: reply.accepted], reply.cached_tokens)


async def check_live(stub, live: set[str]) -> None:
    info = await stub.Info(common_pb2.InfoRequest())
    assert info.live_sessions == len(live), (info.live_sessions, live)


async def good_call_works(stub) -> None:
    """A well-formed Prefill + Propose/Decode + Release still answers in the middle of the fuzzing."""
    committed = [785, 8251, 7640, 389]
    prefix = common_pb2.SessionCursor(session_id="good", start=0, fingerprint=0, tokens=committed[:3])
    await stub.Prefill(common_pb2.PrefillRequest(cursor=prefix))
    cursor = common_pb2.SessionCursor(
        session_id="good", start=3, fingerprint=fingerprint(committed[:3]), tokens=committed[3:]
    )
    if hasattr(stub, "Propose"):
        reply = await stub.Propose(draft_pb2.ProposeRequest(cursor=cursor, num_draft_tokens=3))
        assert len(reply.draft_tokens) == 3
    else:
        reply = await stub.Decode(target_pb2.DecodeRequest(cursor=cursor))
        assert len(reply.emitted_tokens) == 1
    await stub.Release(common_pb2.ReleaseRequest(session_id="good"))


def fuzz_service(role: str, session_methods: list[str]):
    service = {"draft": "specd.v1.DraftService", "target": "specd.v1.TargetService"}[role]

    @FUZZ
    @given(data=st.data())
    async def test(tiny_services, data):
        state = tiny_services.__dict__.setdefault("fuzz_state", (Tracker(), set(), []))
        stub = getattr(tiny_services, role)
        channel = getattr(tiny_services, f"{role}_channel")
        for _ in range(data.draw(st.integers(1, 3))):
            await one_call(data, stub, channel, service, state[0], state[1], session_methods)
        tracker, live = state[0], state[1]
        for session in tracker.uncertain - live:
            await stub.Release(common_pb2.ReleaseRequest(session_id=session))
            tracker.held.pop(session, None)
        tracker.uncertain.clear()
        await check_live(stub, live)
        state[2].append(1)
        if len(state[2]) % 100 == 0:  # every 100 cases: empty the service, then a good call must work
            for session in state[1]:
                await stub.Release(common_pb2.ReleaseRequest(session_id=session))
            state[1].clear()
            state[0].held.clear()
            await good_call_works(stub)

    return test


test_fuzz_draft_service = fuzz_service("draft", ["Propose"])
test_fuzz_target_service = fuzz_service("target", ["Verify", "Decode"])


# -- the OpenAI-compatible HTTP API -----------------------------------------------------------------

HTTP_FUZZ = settings(
    max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
SURROGATES = st.sampled_from(["\ud800", "ab\udfff", "\udc00\U0001f600"])  # valid JSON, no Unicode
ANY = st.recursive(  # any JSON value, NaN and infinities included (Python's json takes them)
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(2**32 - 2, 2**70)
    | st.floats()
    | st.text(max_size=8)
    | SURROGATES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | SURROGATES, inner, max_size=3),
    max_leaves=8,
)
# A bad token count: never null or a valid count above 3, either a long generation (chat's default
# is all that fits).
BAD_COUNT = (
    st.integers(max_value=0)
    | st.integers(5000, 2**70)
    | st.floats()
    | st.booleans()
    | st.text(max_size=4)
    | SURROGATES
    | st.lists(ANY, max_size=2)
    | st.dictionaries(st.text(max_size=3), ANY, max_size=2)
)
TOKEN_IDS = st.lists(st.integers(0, 2000), min_size=1, max_size=6)
CONTENT = st.text(max_size=12) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": CONTENT},
    optional={"name": st.text(max_size=4)},
)
BAD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["tool", "wizard", "User"]) | ANY, "content": CONTENT | ANY}, optional={"name": ANY}
)
WELL_FORMED = {
    "max_tokens": st.integers(1, 3),
    "prompt": st.text(min_size=1, max_size=12)
    | TOKEN_IDS
    | st.lists(TOKEN_IDS | st.text(min_size=1), min_size=1, max_size=2),
    "messages": st.lists(st.one_of(*[MESSAGE] * 6, BAD_MESSAGE), min_size=1, max_size=3),  # one in 7 bad
    "max_completion_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=5),
    "n": st.integers(1, 2),
    "logprobs": st.sampled_from([0, 2, False, True]),  # completions take 0..5, chat true or false
    "top_logprobs": st.integers(0, 3),
    "echo": st.booleans(),
    "specd": st.fixed_dictionaries({}, optional={"draft_tokens": st.integers(0, 8), "trace": st.booleans()}),
    "guided_json": ANY,  # not an OpenAI field: always refused
}


def json_body(data, chat: bool, model: str) -> dict:
    """`model`, `max_tokens`, the prompt or messages and up to four other fields, each well-formed
    four times in five, else bad: any JSON value (for a token count, BAD_COUNT)."""
    prompt = "messages" if chat else "prompt"
    others = [name for name in WELL_FORMED if name not in ("max_tokens", "prompt", "messages")]
    others = [name for name in others if chat or name != "max_completion_tokens"]
    names = ["model", "max_tokens", prompt, *data.draw(st.lists(st.sampled_from(others), unique=True, max_size=4))]
    body = {}
    for name in names:
        if data.draw(st.sampled_from([True] * 4 + [False])):
            body[name] = model if name == "model" else data.draw(WELL_FORMED[name])
        else:
            body[name] = data.draw(BAD_COUNT if name.startswith("max_") else ANY)
    return body


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@HTTP_FUZZ
@given(data=st.data())
async def test_fuzz_http_api_never_answers_5xx(tiny_http, path, data):
    base, model = tiny_http
    kind = data.draw(st.sampled_from(["object"] * 8 + ["any", "bytes"]))
    if kind == "bytes":
        body = data.draw(st.binary(max_size=40))
    elif kind == "any":
        body = data.draw(ANY)
    else:
        body = json_body(data, path.startswith("chat"), model)
    status, text = await http("POST", f"{base}/v1/{path}", body)
    event(f"HTTP {status}")  # --hypothesis-show-statistics: how many generated
    assert status < 500, (status, text)
    if status != 200:
        error = json.loads(text)["error"]
        assert error["type"] == "invalid_request_error" and error["message"], text
    elif text.startswith("data: "):
        assert text.endswith("data: [DONE]\n\n") and '"server_error"' not in text, text
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] in ("length", "stop"), text


async def test_after_the_http_fuzzing_the_api_serves_and_holds_no_session(tiny_stack, tiny_http):
    stack, (base, model) = tiny_stack, tiny_http
    body = {"model": model, "prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True}
    status, text = await http("POST", f"{base}/v1/completions", body)
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 4
    assert await sessions_released(stack)
