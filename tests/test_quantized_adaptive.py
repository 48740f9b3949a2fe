"""A quantized draft and an adaptive K change speed, never the output: greedy equals speculation off."""

import pytest
import torch
from conftest import start_stack, stop_stack
from test_orchestrator import PROMPTS, generate, request

from specd.model.loading import load_model
from specd.proto.limits import Limits
from specd.v1 import common_pb2


async def expect_exact_and_adaptive(stack, max_new_tokens: int = 24) -> list:
    """Every prompt: the adaptive request (K unset) equals K = 0, and its stats describe each step's K."""
    finals = []
    for prompt in PROMPTS:
        baseline, baseline_text, _ = await generate(stack.client, request(prompt, 0, max_new_tokens))
        tokens, text, final = await generate(stack.client, request(prompt, None, max_new_tokens))
        assert tokens == baseline, prompt
        assert text == baseline_text
        stats = final.stats
        assert stats.adaptive and stats.draft_tokens == 8  # the orchestrator's default bound
        assert len(stats.draft_lengths) == stats.steps
        assert sum(stats.draft_lengths) == stats.drafted
        assert all(0 <= k <= 8 for k in stats.draft_lengths)
        finals.append(final)
    return finals


async def test_adaptive_k_equals_speculation_off_and_drafts(tiny_loaded, ray_local):
    """On a stack of its own: the shared one's workers carry costs and a spent probe budget from
    earlier tests (orchestrator/adaptive.py: probes are paid from a budget a worker keeps)."""
    stack = await start_stack(tiny_loaded["draft"], tiny_loaded["target"], Limits(max_sessions=8))
    try:
        finals = await expect_exact_and_adaptive(stack)
        lengths = [k for final in finals for k in final.stats.draft_lengths]
        assert any(k > 0 for k in lengths)  # a tiny target verifies K tokens at the price of one: it speculates
        info = await stack.client.Info(common_pb2.InfoRequest())
        assert info.adaptive_draft_tokens and info.max_draft_tokens == 8
    finally:
        await stop_stack(stack)


async def test_a_fixed_k_overrides_the_chooser(tiny_stack):
    tokens, _, final = await generate(tiny_stack.client, request(PROMPTS[0], 3, 24))
    assert not final.stats.adaptive and final.stats.draft_tokens == 3
    # The first step is the target's alone (the first token never waits for the draft); only the
    # last may be shorter than K (tokens left).
    assert final.stats.draft_lengths[0] == 0 and set(final.stats.draft_lengths[1:-1]) == {3}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
async def test_quantized_draft_keeps_greedy_output_exact(tiny_dirs, tiny_loaded, ray_local, scheme):
    draft = load_model(str(tiny_dirs["draft"]), "float32", quantization=scheme)
    quantized = [
        type(module.weight).__name__ for module in draft.model.modules() if isinstance(module, torch.nn.Linear)
    ]
    assert any(name != "Parameter" for name in quantized), quantized  # torchao's tensors replaced the weights
    stack = await start_stack(draft, tiny_loaded["target"], Limits(max_sessions=8))
    try:
        info = await stack.services.draft.Info(common_pb2.InfoRequest())
        assert info.quantization == scheme
        finals = await expect_exact_and_adaptive(stack)
        assert sum(final.stats.drafted for final in finals) > 0
        tokens, _, final = await generate(stack.client, request(PROMPTS[2], 4, 24))  # and a fixed K
        assert tokens == (await generate(stack.client, request(PROMPTS[2], 0, 24)))[0]
        assert final.stats.accepted > 0  # the quantized draft still guesses right at times
    finally:
        await stop_stack(stack)
