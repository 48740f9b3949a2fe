"""The orchestrator over the real pair (conftest's `real_stack`: the llama.cpp engine, exact by
construction): speculation changes speed, never tokens, at any K, with requests side by side, with an
int4 transformers draft choosing K every step; a seed reproduces a sampled answer; EOS ends a chat.

The same properties on the transformers engine: its real-pair exactness is tests/test_real_pair.py's
(a verify of K = 1 and 4 over real gRPC equals HF generate in float32), and the orchestrator's K sweep,
concurrency, seeds and adaptive K over it run on tiny models (tests/test_orchestrator.py,
tests/test_adaptive.py, tests/test_quantized_adaptive.py): the orchestrator does not know which engine
a service runs.
"""

import asyncio

import pytest
from conftest import REAL_NEW_TOKENS, REAL_PROMPTS, stop_stack

from specd.proto.client import complete, make_request
from specd.v1 import common_pb2

pytestmark = pytest.mark.real


@pytest.mark.parametrize("k", [1, 3, 5, 8, None])  # None: K chosen every step
async def test_greedy_speculative_output_equals_speculation_off(real_stack, real_baselines, k):
    drafted = 0
    for prompt in REAL_PROMPTS:
        result = await complete(
            real_stack.client, make_request(prompt, REAL_NEW_TOKENS, draft_tokens=k, ignore_eos=True)
        )
        assert result.token_ids == real_baselines[prompt].token_ids, (prompt, k)
        assert result.text == real_baselines[prompt].text
        stats = result.final.stats
        drafted += stats.drafted
        if k is not None:
            assert stats.accepted > 0 and stats.steps < REAL_NEW_TOKENS  # the draft really helped
            assert len(stats.accepted_per_position) == k
    assert k is None or drafted > 0


async def test_three_concurrent_requests_stay_exact(real_stack, real_baselines):
    results = await asyncio.gather(
        *(
            complete(real_stack.client, make_request(p, REAL_NEW_TOKENS, draft_tokens=4, ignore_eos=True))
            for p in REAL_PROMPTS
        )
    )
    for prompt, result in zip(REAL_PROMPTS, results):
        assert result.token_ids == real_baselines[prompt].token_ids, prompt
    assert await real_stack.live_sessions() == (0, 0)


async def test_sampling_reproducible_by_seed(real_stack):
    def sampled(seed):
        return complete(
            real_stack.client,
            make_request(REAL_PROMPTS[0], 16, temperature=0.9, seed=seed, draft_tokens=4, ignore_eos=True),
        )

    first, again, other = await sampled(1), await sampled(1), await sampled(2)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


async def test_eos_ends_a_chat_answer(real_stack):
    prompt = "<|im_start|>user\nReply with the single word: yes<|im_end|>\n<|im_start|>assistant\n"
    result = await complete(real_stack.client, make_request(prompt, 32, draft_tokens=4))
    assert result.final.finish_reason == "stop"
    assert result.final.usage.completion_tokens < 32 and "yes" in result.text.lower()


async def test_adaptive_k_over_an_int4_draft_equals_speculation_off(real_stack, real_baselines, tmp_path):
    """An int4 draft on the transformers engine (`specd serve draft --engine transformers --quantize
    int4`, a process of its own), K chosen every step, in front of the real stack's target service:
    the output is the target's own."""
    from conftest import real_draft_process, stack_over

    flags = ("--engine", "transformers", "--quantize", "int4")
    async with real_draft_process(real_stack.services, tmp_path / "draft.log", *flags) as services:
        stack = await stack_over(services)
        try:
            drafted = accepted = 0
            for prompt in REAL_PROMPTS:
                result = await complete(stack.client, make_request(prompt, REAL_NEW_TOKENS, ignore_eos=True))
                assert result.token_ids == real_baselines[prompt].token_ids, prompt
                stats = result.final.stats
                assert stats.adaptive and len(stats.draft_lengths) == stats.steps
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
            # Each fresh worker drafts once to measure (whether it then stays on depends on this CPU).
            assert drafted > 0 and accepted > 0
            info = await services.draft.Info(common_pb2.InfoRequest())
            assert info.quantization == "int4"
        finally:
            await stop_stack(stack)
