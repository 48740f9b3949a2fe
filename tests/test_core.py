"""The transport-neutral core (orchestrator/core.py) without servers or Ray: validation and
tokenizing, the metrics of started and refused requests, Info, and the one stats serialisation."""

import math

import grpc
import pytest
from prometheus_client import generate_latest
from tokenizers import Tokenizer, models, pre_tokenizers

from specd.orchestrator.core import STEP_FIELDS, BadRequest, Core, stats_dict, stats_proto
from specd.orchestrator.generation import Delta, Finished, Stats
from specd.orchestrator.remote import ServicePair
from specd.v1 import common_pb2, specdecode_pb2

VOCAB = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}


def tokenizer() -> Tokenizer:
    made = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    made.pre_tokenizer = pre_tokenizers.Whitespace()
    return made


def info(role: str, max_session_tokens: int, max_draft_tokens: int) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model=f"{role}-model",
        role=role,
        vocab_size=100,
        max_session_tokens=max_session_tokens,
        max_draft_tokens=max_draft_tokens,
    )


class FakePool:
    """Records what it was asked to run and answers with one Delta and a Finished."""

    def __init__(self):
        self.actors = ["a", "b", "c"]
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        yield Delta("hi", [1])
        stats = Stats(steps=1, draft_lengths=[0], step_seconds=[(0, 1, 0)])
        yield Finished("length", len(request.prompt_ids), 1, stats)


class FakeService:
    """Answers Info with what the service holds now, or is down (UNAVAILABLE)."""

    def __init__(self, answer: common_pb2.ModelInfo | None):
        self.answer = answer

    async def Info(self, request, timeout=None):
        if self.answer is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
        return self.answer


def core(draft_now=None, target_now=None, **options) -> Core:
    stubs = FakeService(draft_now), FakeService(target_now)
    pair = ServicePair(*stubs, info("draft", 48, 6), info("target", 64, 8), tokenizer(), ())
    return Core(pair, FakePool(), **options)


def request(prompt="hello world", max_new_tokens=4, **fields) -> specdecode_pb2.GenerateRequest:
    return specdecode_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, **fields)


def test_prepare_tokenizes_and_fills_in_the_servers_defaults():
    prepared = core(default_draft_tokens=None, max_draft_tokens=12).prepare(
        request("hello again", 5, stop=["x"], ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0.5)),
        time_remaining=None,
    )
    assert prepared.prompt_ids == [1, 3] and prepared.max_new_tokens == 5 and prepared.stop == ["x"]
    assert prepared.draft_tokens is None  # adaptive
    assert prepared.max_draft_tokens == 6  # no more than the services take (the draft: 6)
    assert prepared.top_p == 1.0 and prepared.ignore_eos and prepared.deadline is None
    fixed = core(default_draft_tokens=3).prepare(request(prompt="", prompt_token_ids=[7, 8], draft_tokens=0), 2.0)
    assert fixed.prompt_ids == [7, 8] and fixed.draft_tokens == 0  # asked for: speculation off
    assert fixed.deadline is not None
    assert core(default_draft_tokens=3).prepare(request(), None).draft_tokens == 3
    assert core().prepare(request(cache_salt="t" * 256), None).cache_salt == "t" * 256  # the longest taken
    assert core().prepare(request(), None).cache_salt == ""


@pytest.mark.parametrize(
    "message, says",
    [
        (request(prompt=""), "prompt is empty"),
        (request(prompt="", prompt_token_ids=[1, 100]), "outside the vocabulary of 100"),
        (request(max_new_tokens=0), "at least 1"),
        (request(max_new_tokens=47), "exceeds the 48 tokens"),  # the draft's sessions are the shorter
        (request(sampling=common_pb2.SamplingParams(temperature=-1)), "temperature"),
        (request(sampling=common_pb2.SamplingParams(temperature=math.inf)), "temperature"),
        (request(sampling=common_pb2.SamplingParams(temperature=math.nan)), "temperature"),
        (request(sampling=common_pb2.SamplingParams(top_p=1.5)), "top_p"),
        (request(draft_tokens=7), "K=7 is above the largest the services accept (6)"),
        (request(cache_salt="s" * 257), "cache_salt must be at most 256 characters, got 257"),
    ],
)
def test_prepare_refuses_bad_requests_with_a_message_to_act_on(message, says):
    with pytest.raises(BadRequest) as refused:
        core().prepare(message, None)
    assert says in str(refused.value)


def test_the_prompt_limit_applies_when_set():
    with pytest.raises(BadRequest, match="accepts at most 1"):
        core(max_prompt_tokens=1).prepare(request(), None)
    assert core(max_prompt_tokens=2).prepare(request(), None).prompt_ids == [1, 2]


def sample(registry, name: str) -> float:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_start_runs_on_the_pool_and_counts_every_request():
    served = core()
    events = [event async for event in served.start(request(), "api-a")]
    assert [type(event) for event in events] == [Delta, Finished] and served.pool.requests[0].prompt_ids == [1, 2]
    with pytest.raises(BadRequest):
        served.start(request(prompt=""), "api-a")
    served.rejected("api-b", "NOT_FOUND")
    registry = served.metrics.registry
    assert sample(registry, 'specd_requests_total{api="api-a",outcome="length"}') == 1
    assert sample(registry, 'specd_requests_total{api="api-a",outcome="INVALID_ARGUMENT"}') == 1
    assert sample(registry, 'specd_requests_total{api="api-b",outcome="NOT_FOUND"}') == 1
    assert len(served.pool.requests) == 1  # the refused one never reached the pool


async def test_info_and_the_served_pair():
    served = core(default_draft_tokens=None)
    reply = await served.info()
    assert reply.workers == 3 and reply.adaptive_draft_tokens and reply.max_draft_tokens == 6
    assert reply.draft.role == "draft" and reply.target.role == "target"
    assert (await core(default_draft_tokens=4).info()).default_draft_tokens == 4
    assert served.model_name == "target-model" and served.room == 48


async def test_info_reports_what_the_services_hold_now_and_what_they_said_when_one_is_down():
    target_now = info("target", 64, 8)
    target_now.live_sessions, target_now.batch_sizes[2] = 3, 7
    reply = await core(target_now=target_now).info()  # the draft is down
    assert reply.target.live_sessions == 3 and dict(reply.target.batch_sizes) == {2: 7}
    assert reply.draft.model == "draft-model" and reply.draft.live_sessions == 0  # as it was at connect time


def stats() -> Stats:
    made = Stats(draft_tokens=4, adaptive=True)
    for k, accepted, times in ((4, 2, (0.4, 1.0, 0.1)), (0, 0, (0.0, 0.9, 0.05)), (3, 3, (0.3, 1.1, 0.2))):
        made.record_step(k, accepted)
        made.record_times(times[0], times[0], times[1] + times[2], times[1])
    made.total_seconds, made.completion_tokens, made.time_to_first_token_s, made.resyncs = 5.0, 10, 0.5, 1
    return made


def test_one_stats_serialisation_for_both_apis():
    fields = {field.name for field in specdecode_pb2.SpeculationStats.DESCRIPTOR.fields}
    answer = stats_dict(stats())
    assert set(answer) == fields  # every SpeculationStats field, by its own name
    assert set(stats_dict(stats(), steps=False)) == fields - set(STEP_FIELDS)
    message = stats_proto(stats())
    for name, value in answer.items():
        got = getattr(message, name)
        assert (list(got) if isinstance(value, list) else got) == pytest.approx(value), name
    assert answer["drafting_steps"] == 2 and answer["draft_lengths"] == [4, 0, 3]
    assert answer["step_draft_seconds"] == [0.4, 0.0, 0.3] and answer["step_verify_seconds"] == [1.0, 0.9, 1.1]
    assert answer["acceptance_rate"] == pytest.approx(5 / 7)
    assert answer["other_seconds"] == pytest.approx(5 - 0.7 - 3.35)  # total - draft walls - verify walls


async def test_the_prompt_tokens_served_from_cache_reach_the_final_usage_and_the_metrics():
    from specd.orchestrator.grpc_api import to_proto

    class CachedPool(FakePool):
        async def generate(self, request):
            self.requests.append(request)
            yield Finished("length", len(request.prompt_ids), 1, Stats(), cached_prompt_tokens=2)

    served = core()
    served.pool = CachedPool()
    (finished,) = [event async for event in served.start(request("hello world again"), "api-a")]
    assert served.pool.requests[0].cache_salt == ""
    usage = to_proto(finished).final.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (3, 1, 2)
    assert sample(served.metrics.registry, "specd_cached_prompt_tokens_total") == 2
    assert sample(served.metrics.registry, "specd_prompt_tokens_total") == 3
