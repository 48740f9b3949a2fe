"""Decode runs (target.proto DecodeRequest.steps): the target decodes a run of tokens in one call,
exactly as that many single Decode calls would, on each engine; and the orchestrator asks for runs
while speculation is off, with the same output."""

import asyncio

import grpc
import pytest
from conftest import SERVICE_ENGINES, serve_engines
from fake_services import Tokenless
from test_services import GREEDY, cursor, expect_status, prefill

from specd.orchestrator import adaptive
from specd.orchestrator.generation import Finished, Generation, GenerationRequest
from specd.proto.limits import MAX_DECODE_STEPS, Limits
from specd.v1 import common_pb2, target_pb2

PROMPT = [785, 8251, 7640, 389, 279, 5837, 13, 576]
SAMPLED = common_pb2.SamplingParams(temperature=0.9, top_k=50, seed=11)


@pytest.fixture(params=SERVICE_ENGINES)
async def services(request, tiny_engines):
    engines = tiny_engines(request.param)
    services = await serve_engines(engines["draft"], engines["target"], Limits(max_sessions=8, max_session_tokens=64))
    yield services
    await services.close()


async def one_at_a_time(target, session: str, n: int, sampling=GREEDY, **options) -> tuple[list[int], list[float]]:
    """n single Decode calls after the prompt: the tokens and their log-probabilities."""
    committed, logprobs = list(PROMPT), []
    await prefill(target, session, committed[:-1])
    for _ in range(n):
        request = target_pb2.DecodeRequest(
            cursor=cursor(session, committed, len(committed) - 1), sampling=sampling, **options
        )
        reply = await target.Decode(request)
        committed += reply.emitted_tokens
        logprobs += reply.logprobs
    return committed[len(PROMPT) :], logprobs


async def run(target, session: str, steps: int, sampling=GREEDY, stops=(), **options) -> target_pb2.VerifyResponse:
    """One Decode run of `steps` after the prompt."""
    await prefill(target, session, PROMPT[:-1])
    request = target_pb2.DecodeRequest(
        cursor=cursor(session, PROMPT, len(PROMPT) - 1),
        sampling=sampling,
        steps=steps,
        stop_token_ids=list(stops),
        **options,
    )
    return await target.Decode(request)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_a_run_emits_what_single_decodes_would(services, sampling):
    expected, expected_logprobs = await one_at_a_time(services.target, "single", 12, sampling, return_logprobs=True)
    reply = await run(services.target, "run", 12, sampling, return_logprobs=True)
    assert list(reply.emitted_tokens) == expected
    assert list(reply.logprobs) == pytest.approx(expected_logprobs, abs=1e-5)
    assert reply.accepted == 0
    assert reply.cached_tokens == len(PROMPT) + 12 - 1  # the last token has no KV yet
    # The session goes on from the run like from any call: the next Decode continues it.
    committed = PROMPT + list(reply.emitted_tokens)
    after = await services.target.Decode(
        target_pb2.DecodeRequest(cursor=cursor("run", committed, reply.cached_tokens), sampling=sampling)
    )
    longer, _ = await one_at_a_time(services.target, "single-13", 13, sampling)
    assert list(after.emitted_tokens) == longer[-1:]


async def test_a_run_stops_after_a_stop_token(services):
    expected, _ = await one_at_a_time(services.target, "single", 10)
    stop = expected[3]
    reply = await run(services.target, "run", 10, stops=[stop, 151_643])
    first = expected.index(stop)
    assert list(reply.emitted_tokens) == expected[: first + 1]
    assert reply.cached_tokens == len(PROMPT) + first


async def test_a_run_ends_where_the_session_is_full(services):
    """max_session_tokens is 64 here: the run emits what fits, instead of failing."""
    reply = await run(services.target, "run", MAX_DECODE_STEPS)
    assert len(reply.emitted_tokens) == 64 - len(PROMPT) + 1
    assert reply.cached_tokens == 64


async def test_steps_past_the_bound_are_refused(services):
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, run(services.target, "run", MAX_DECODE_STEPS + 1))
    info = await services.target.Info(common_pb2.InfoRequest())
    assert info.live_sessions == 1  # the prefill's session, untouched: the refusal came before any pass
    reply = await services.target.Decode(
        target_pb2.DecodeRequest(cursor=cursor("run", PROMPT, len(PROMPT) - 1), steps=2)
    )
    assert len(reply.emitted_tokens) == 2


async def test_concurrent_runs_share_passes_and_equal_runs_alone(services):
    alone = [list((await run(services.target, f"alone-{i}", 9, SAMPLED)).emitted_tokens) for i in range(3)]
    together = await asyncio.gather(*(run(services.target, f"together-{i}", 9, SAMPLED) for i in range(3)))
    assert [list(reply.emitted_tokens) for reply in together] == alone
    info = await services.target.Info(common_pb2.InfoRequest())
    assert max(info.batch_sizes) >= 2  # the runs' steps shared passes


class Recorder:
    """The target's stub, recording the steps each Decode asks for."""

    def __init__(self, target):
        self.target, self.steps = target, []

    def Decode(self, request, **kwargs):
        self.steps.append(request.steps)
        return self.target.Decode(request, **kwargs)

    def __getattr__(self, name):
        return getattr(self.target, name)


async def generate(services, draft_tokens: int | None, **sampling) -> tuple[list[int], object, list[int]]:
    """The output, Stats and each Decode's steps of one request (the draft model guesses, if anything)."""
    request = GenerationRequest(
        list(PROMPT), 40, draft_tokens=draft_tokens, ignore_eos=True, drafter="model", **sampling
    )
    target = Recorder(services.target)
    tokens, stats = [], None
    async for event in Generation(request, services.draft, target, Tokenless(), set()).run():
        if isinstance(event, Finished):
            stats = event.stats
        else:
            tokens += event.token_ids
    return tokens, stats, target.steps


@pytest.mark.parametrize("draft_tokens", [0, None], ids=["off", "adaptive"])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, seed=5)], ids=["greedy", "sampled"])
async def test_the_orchestrator_decodes_in_runs_and_the_output_stays(services, draft_tokens, sampling, monkeypatch):
    """Off, a target-only step asks for a run (here every run MAX_DECODE_RUN = 6 long) once a decode's
    time is known: one token on the first step (the prefill) and the second; the output equals that
    of one token per step."""
    monkeypatch.setattr(adaptive, "MAX_DECODE_RUN", 1)
    single, _, steps = await generate(services, draft_tokens, **sampling)
    assert set(steps) == {0}  # no runs: one token a Decode
    monkeypatch.setattr(adaptive, "MAX_DECODE_RUN", 6)
    monkeypatch.setattr(adaptive, "DECODE_RUN_SECONDS", 1e6)
    tokens, stats, steps = await generate(services, draft_tokens, **sampling)
    assert tokens == single and len(tokens) == 40
    assert steps[:2] == [0, 0]
    if draft_tokens == 0:
        assert steps[2:] == [6] * 6 + [2]  # 38 tokens left: runs of 6, the last one to the budget
        assert stats.steps == 9 and len(stats.draft_lengths) == 9  # a run is one step
    else:  # every target-only step but the last (the budget's last token) is a run
        assert all(step > 1 for step in steps[2:-1])


@pytest.mark.parametrize("streams, run", [(1, 1), (4, 6)])
def test_a_lookup_passed_over_shortens_the_run_only_when_alone(streams, run, monkeypatch):
    """Where the prompt lookup had guesses and they were not worth verifying, a lone stream asks for
    one token (the lookup looks again after it: alone, its guesses often pay); under load its
    guesses are priced for the others' waiting too and rarely pay, so the stream keeps its run
    rather than paying a round trip a token (measured beside --no-speculation at 2-8 streams)."""
    monkeypatch.setattr(adaptive, "MAX_DECODE_RUN", 6)
    costs = adaptive.ServiceCosts()
    costs.seed([], [0.01] * 9)
    costs.target_streams = streams
    request = GenerationRequest(list(PROMPT), 40, drafter="suffix")
    generation = Generation(request, None, None, Tokenless(), set(), costs=costs)
    generation.stats.steps, generation.lookup_offered = 3, True
    assert generation.run_options().get("steps", 1) == run
    generation.lookup_offered = False
    assert generation.run_options()["steps"] == 6
