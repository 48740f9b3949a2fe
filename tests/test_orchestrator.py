"""The orchestrator on Ray over tiny models: exactness, sampling, stops, cancel, resync."""

import asyncio

import grpc
import pytest

from specd.v1 import common_pb2, specdecode_pb2

PROMPTS = ["def quicksort(arr):", "The capital of France is", "import numpy as np\n\ndef softmax(x):"]


def request(prompt: str, k: int | None, max_new_tokens: int = 24, **sampling) -> specdecode_pb2.GenerateRequest:
    message = specdecode_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=max_new_tokens, sampling=common_pb2.SamplingParams(**sampling), ignore_eos=True
    )
    if k is not None:
        message.draft_tokens = k
    return message


async def generate(client, message) -> tuple[list[int], str, specdecode_pb2.Final]:
    tokens, text, final = [], "", None
    async for reply in client.Generate(message):
        if reply.HasField("delta"):
            tokens += reply.delta.token_ids
            text += reply.delta.text
        else:
            final = reply.final
    return tokens, text, final


async def test_greedy_speculative_equals_speculation_off_for_every_k(tiny_stack):
    for prompt in PROMPTS:
        baseline, baseline_text, final = await generate(tiny_stack.client, request(prompt, 0))
        assert len(baseline) == 24 and final.finish_reason == "length" and final.stats.drafted == 0
        runs = await asyncio.gather(*(generate(tiny_stack.client, request(prompt, k)) for k in (1, 3, 5, 8)))
        for k, (tokens, text, final) in zip((1, 3, 5, 8), runs):
            assert tokens == baseline, (prompt, k)
            assert text == baseline_text
            assert final.stats.draft_tokens == k and final.stats.drafted > 0
            assert final.stats.steps < 24  # some guesses were accepted: fewer target passes than tokens
            assert final.stats.mean_accepted_length == pytest.approx(1 + final.stats.accepted / final.stats.steps)
            assert sum(final.stats.accepted_per_position) == final.stats.accepted


async def test_three_concurrent_requests_each_equal_their_own_baseline(tiny_stack):
    baselines = [await generate(tiny_stack.client, request(p, 0)) for p in PROMPTS]
    concurrent = await asyncio.gather(*(generate(tiny_stack.client, request(p, 4)) for p in PROMPTS))
    assert [run[0] for run in concurrent] == [run[0] for run in baselines]


async def test_sampling_is_reproducible_by_seed(tiny_stack):
    first = await generate(tiny_stack.client, request(PROMPTS[0], 4, temperature=1.0, seed=5))
    again = await generate(tiny_stack.client, request(PROMPTS[0], 4, temperature=1.0, seed=5))
    other = await generate(tiny_stack.client, request(PROMPTS[0], 4, temperature=1.0, seed=6))
    assert first[0] == again[0]
    assert first[0] != other[0]


async def test_max_new_tokens_and_stop_strings(tiny_stack):
    tokens, text, final = await generate(tiny_stack.client, request(PROMPTS[1], 4, max_new_tokens=7))
    assert len(tokens) == 7 and final.finish_reason == "length" and final.usage.completion_tokens == 7
    _, full_text, _ = await generate(tiny_stack.client, request(PROMPTS[1], 4, max_new_tokens=24))
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    message = request(PROMPTS[1], 4, max_new_tokens=24)
    message.stop.append(stop)
    _, stopped_text, final = await generate(tiny_stack.client, message)
    assert final.finish_reason == "stop"
    assert stopped_text == full_text[: full_text.index(stop)]


@pytest.mark.parametrize(
    "message, fragment",
    [
        (specdecode_pb2.GenerateRequest(prompt="", max_new_tokens=4), "empty"),
        (specdecode_pb2.GenerateRequest(prompt="hi " * 5000, max_new_tokens=4), "exceeds"),
        (specdecode_pb2.GenerateRequest(prompt="hi", max_new_tokens=0), "max_new_tokens"),
        (specdecode_pb2.GenerateRequest(prompt="hi", max_new_tokens=4, draft_tokens=99), "K=99"),
        (
            specdecode_pb2.GenerateRequest(
                prompt="hi", max_new_tokens=4, sampling=common_pb2.SamplingParams(temperature=-1)
            ),
            "temperature",
        ),
        (specdecode_pb2.GenerateRequest(prompt_token_ids=[999_999], max_new_tokens=4), "vocabulary"),
    ],
)
async def test_bad_requests_are_invalid_argument(tiny_stack, message, fragment):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(tiny_stack.client, message)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in caught.value.details()


async def test_client_cancel_mid_stream_releases_both_sessions(tiny_stack):
    call = tiny_stack.client.Generate(request(PROMPTS[0], 4, max_new_tokens=200))
    async for reply in call:
        if reply.HasField("delta"):
            break
    assert sum(await tiny_stack.live_sessions()) > 0
    call.cancel()
    for _ in range(100):
        if await tiny_stack.live_sessions() == (0, 0):
            break
        await asyncio.sleep(0.05)
    assert await tiny_stack.live_sessions() == (0, 0)


async def test_lost_sessions_mid_request_are_resynced_and_output_stays_exact(tiny_stack, tiny_loaded):
    baseline, _, _ = await generate(tiny_stack.client, request(PROMPTS[2], 0, max_new_tokens=40))
    services = tiny_stack.services
    target_port = services.target_server.port
    tokens, final, steps = [], None, 0
    message = request(PROMPTS[2], 3, max_new_tokens=40)
    message.drafter = "model"  # every step calls the draft (a lookup could guess the rest: the baseline is indexed)
    async for reply in tiny_stack.client.Generate(message):
        if reply.HasField("final"):
            final = reply.final
            continue
        tokens += reply.delta.token_ids
        steps += 1
        if steps == 2:  # the draft evicts every session, on its model thread (the store's one owner)
            evict_all = lambda service: [*map(service.store.release, [*service.store.sessions])]  # noqa: E731
            await services.draft_server.thread.run(evict_all)
        if steps == 4:  # the target process "restarts": a new server on the same port, empty caches
            await services.target_server.stop(0)
            from specd.model.transformers_engine import TransformersEngine
            from specd.target_service.server import create_target_server
            from specd.target_service.verifier import Verifier

            limits = services.target_server.thread.service.limits

            def restarted(limits=limits):
                return Verifier(TransformersEngine(tiny_loaded["target"]), limits)

            services.target_server = create_target_server(restarted)
            await services.target_server.start(f"127.0.0.1:{target_port}")
            await services.target_server.load()
    assert tokens == baseline
    assert final.stats.resyncs >= 2
