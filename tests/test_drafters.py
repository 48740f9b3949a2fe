"""Who guesses, end to end on the tiny stack: the draft model, the prompt lookup (no draft call),
or each step the better of the two. The target decides every token, so greedy output is the same
whoever guessed; a sampled lookup guess goes to the target with a one-hot q."""

import asyncio

import grpc
import pytest
from test_openai_api import sessions_released
from test_orchestrator import generate, request

from specd.v1 import specdecode_pb2

# Text that repeats: the lookup finds its continuation (and a tiny random model repeats itself too)
REPEATS = "def area(width, height):\n    return width * height\n\n\n" * 3 + "def area(width, height):\n"
DRAFTERS = ("model", "ngram", "hybrid")


def with_drafter(message: specdecode_pb2.GenerateRequest, drafter: str) -> specdecode_pb2.GenerateRequest:
    message.drafter = drafter
    return message


async def test_greedy_output_is_the_same_whoever_guesses(tiny_stack):
    baseline, _, _ = await generate(tiny_stack.client, request(REPEATS, 0, max_new_tokens=48))
    runs = {
        (drafter, k): generate(tiny_stack.client, with_drafter(request(REPEATS, k, max_new_tokens=48), drafter))
        for drafter in DRAFTERS
        for k in (None, 3)
    }
    for (drafter, k), (tokens, _, final) in zip(runs, await asyncio.gather(*runs.values())):
        assert tokens == baseline, (drafter, k)
        stats = final.stats
        assert stats.drafter == drafter
        assert stats.lookup_drafted <= stats.drafted and stats.lookup_accepted <= stats.accepted
        assert stats.lookup_steps <= stats.drafting_steps
        if drafter == "model":
            assert stats.lookup_steps == 0
        if drafter == "ngram":  # every guess is the lookup's, and text that repeats has some
            assert stats.lookup_drafted == stats.drafted > 0 and stats.lookup_steps == stats.drafting_steps


async def test_a_lookup_only_request_never_opens_a_draft_session(tiny_stack):
    assert await sessions_released(tiny_stack)  # the sessions of earlier requests are gone
    message = with_drafter(request(REPEATS, 4, max_new_tokens=200), "ngram")
    call = tiny_stack.client.Generate(message)
    opened, final = set(), None
    async for reply in call:
        opened.add(await tiny_stack.live_sessions())
        final = reply.final if reply.HasField("final") else final
    assert all(draft == 0 for draft, _ in opened), opened
    assert final.stats.lookup_steps > 0


async def test_a_fixed_k_takes_the_lookup_only_when_it_has_k_guesses(tiny_stack):
    _, _, final = await generate(tiny_stack.client, with_drafter(request(REPEATS, 4, max_new_tokens=48), "hybrid"))
    lengths = list(final.stats.draft_lengths)
    assert set(lengths[1:-4]) == {4}  # the lookup's 4 or the model's 4 (but the first step; the last ones: the budget)
    assert final.stats.lookup_steps > 0 and final.stats.lookup_drafted <= 4 * final.stats.lookup_steps


async def test_sampled_lookup_guesses_go_to_the_target_with_a_one_hot_q(tiny_stack):
    """A sampled request (top_k = 1: p is one-hot at the target's argmax, so the output must equal
    greedy's) whose guesses are all the lookup's: the target takes their one-hot q rows (one per
    guess, q > 0 at the guess), and the acceptance rule keeps exactly the guesses p agrees with."""
    greedy, _, _ = await generate(tiny_stack.client, request(REPEATS, 0, max_new_tokens=40))
    message = with_drafter(request(REPEATS, 3, max_new_tokens=40, temperature=1.0, top_k=1, seed=3), "ngram")
    tokens, _, final = await generate(tiny_stack.client, message)
    assert tokens == greedy
    assert final.stats.lookup_steps > 0 and final.stats.lookup_drafted == final.stats.drafted
    assert final.stats.lookup_accepted == final.stats.accepted > 0


async def test_an_unknown_drafter_is_invalid_argument(tiny_stack):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(tiny_stack.client, with_drafter(request(REPEATS, 2), "oracle"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "drafter 'oracle'" in caught.value.details() and "ngram" in caught.value.details()
