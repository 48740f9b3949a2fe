"""The orchestrator over the real pair in float32: speculation changes speed, never tokens."""

import asyncio

import pytest

from specd.proto.client import complete, make_request

pytestmark = pytest.mark.real

PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef softmax(x):",
    "# Write a function that parses an ISO 8601 date string\n",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
async def baselines(real_stack):
    """Speculation off: the target's own greedy output, per prompt."""
    return {
        p: await complete(real_stack.client, make_request(p, NEW_TOKENS, draft_tokens=0, ignore_eos=True))
        for p in PROMPTS
    }


@pytest.mark.parametrize("k", [1, 3, 5, 8])
async def test_greedy_speculative_output_equals_speculation_off(real_stack, baselines, k):
    for prompt in PROMPTS:
        result = await complete(real_stack.client, make_request(prompt, NEW_TOKENS, draft_tokens=k, ignore_eos=True))
        assert result.token_ids == baselines[prompt].token_ids, (prompt, k)
        assert result.text == baselines[prompt].text
        stats = result.final.stats
        assert stats.accepted > 0 and stats.steps < NEW_TOKENS  # the draft really helped
        assert len(stats.accepted_per_position) == k


async def test_three_concurrent_requests_stay_exact(real_stack, baselines):
    results = await asyncio.gather(
        *(complete(real_stack.client, make_request(p, NEW_TOKENS, draft_tokens=4, ignore_eos=True)) for p in PROMPTS)
    )
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == baselines[prompt].token_ids


async def test_sampling_reproducible_by_seed(real_stack):
    def sampled(seed):
        return complete(
            real_stack.client, make_request(PROMPTS[0], 16, temperature=0.9, seed=seed, draft_tokens=4, ignore_eos=True)
        )

    first, again, other = await sampled(1), await sampled(1), await sampled(2)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


async def test_eos_ends_a_chat_answer(real_stack):
    prompt = "<|im_start|>user\nReply with the single word: yes<|im_end|>\n<|im_start|>assistant\n"
    result = await complete(real_stack.client, make_request(prompt, 32, draft_tokens=4))
    assert result.final.finish_reason == "stop"
    assert result.final.usage.completion_tokens < 32 and "yes" in result.text.lower()


async def test_adaptive_k_over_an_int4_draft_equals_speculation_off(real_float32, ray_local, baselines):
    """The defaults of a CPU deployment (an int4 draft, K chosen every step) with a float32 target: exact."""
    from conftest import start_stack, stop_stack

    from specd.model.loading import load_model

    draft = load_model("draft", "float32", quantization="int4")
    stack = await start_stack(draft, real_float32["target"])
    try:
        drafted = accepted = 0
        for prompt in PROMPTS:
            result = await complete(stack.client, make_request(prompt, NEW_TOKENS, ignore_eos=True))
            assert result.token_ids == baselines[prompt].token_ids, prompt
            stats = result.final.stats
            assert stats.adaptive and len(stats.draft_lengths) == stats.steps
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        # Each fresh worker drafts once to measure (whether it then stays on depends on this CPU).
        assert drafted > 0 and accepted > 0
    finally:
        await stop_stack(stack)
