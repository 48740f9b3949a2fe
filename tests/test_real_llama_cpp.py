"""The real pair's GGUF files on the llama.cpp engine (model/llama_cpp_engine.py) behind the real
services (conftest's `real_stack`, loaded once per test session): the engine scores a verify bit for
bit as decode steps, before and past 256 tokens of context; a deployment may mix engines (a
transformers draft, a llama.cpp target) because both describe the same tokenizer; the lookup drafters,
draft-ahead and the prefix cache keep the output. The orchestrator's K sweep and concurrency over the
same stack are tests/test_real_orchestrator.py's.
"""

import pytest
import torch
from conftest import REAL_LIMITS, REAL_NEW_TOKENS, REAL_PROMPTS, real_draft_process, stack_over, stop_stack

from specd.model.engine import Row
from specd.proto.client import complete, make_request
from specd.v1 import common_pb2

pytestmark = pytest.mark.real


async def on_target_thread(stack, work):
    """work(engine) on the target's model thread: its llama context is that thread's alone, and a
    request's Release may have queued work there that is still running (a chat's kept answer)."""
    return await stack.services.target_server.thread.run(lambda service: work(service.engine))


async def test_the_services_run_the_gguf_files(real_stack):
    for stub in (real_stack.services.draft, real_stack.services.target):
        info = await stub.Info(common_pb2.InfoRequest())
        assert info.dtype == "gguf" and "Q" in info.quantization and info.device == "cpu"
        assert info.max_cached_tokens == REAL_LIMITS.max_cached_tokens
        assert info.scored_per_call >= 3  # bitwise: what the probe found (63 with the patched ggml-cpu)
        assert info.splits_rows  # a KV stream per session: a verify among decode steps is priced as a part of its own
    text = (await complete(real_stack.client, make_request(REAL_PROMPTS[0], REAL_NEW_TOKENS, ignore_eos=True))).text
    assert "return" in text or "if" in text, f"not code: {text!r}"


async def test_a_verify_scores_bit_for_bit_as_decode_steps(real_stack):
    """What makes speculation exact on this engine (model/llama_cpp_engine.py): the target's logits
    for K + 1 positions at once equal its one-token decode steps', after rollbacks and beside others.
    Both sessions prefill the prompt alike, as a request does with speculation on or off."""

    def score(engine):
        tokens = engine.tokenizer("def quicksort(items):\n    if len(items) <= 1:\n        return items").input_ids
        prompt = tokens[:4]
        steps = [engine.forward([Row("decode", prompt, 1)])[0]]  # steps[i]: the logits at position 3 + i
        steps += [engine.forward([Row("decode", [token], 1)])[0] for token in tokens[4:]]
        engine.forward([Row("verify", prompt, 1)])
        first = engine.forward([Row("other", tokens[:7], 1), Row("verify", tokens[4:9] + [11, 12], 7)])[1]
        engine.crop("verify", 9)
        engine.release("other")
        scored = engine.forward([Row("verify", tokens[9:], len(tokens) - 9), Row("third", tokens[:3], 2)])[0]
        for session_id in ("decode", "verify", "third"):
            engine.release(session_id)
        return steps, first, scored

    steps, first, scored = await on_target_thread(real_stack, score)
    assert torch.equal(first[:5], torch.cat(steps[1:6]))  # positions 4..8, before the rollback
    assert torch.equal(scored, torch.cat(steps[6:]))  # positions 9.., after it


async def test_past_256_tokens_a_verify_and_a_batched_step_score_as_lone_decode_steps(real_stack):
    """Past 256 tokens of context llama.cpp's attention view grows to 512 cells, where flash attention
    over an F16 K cache splits a lone decode step across threads and rounds otherwise than a verify or
    a step batched beside another session (the engine's docstring, ATTENTION): 300 tokens of context."""

    def score(engine):
        text = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n" * 20
        tokens = engine.tokenizer(text).input_ids[:304]
        assert len(tokens) == 304
        steps = [engine.forward([Row("long", tokens[:301], 1)])[0]]  # steps[i]: the logits at position 300 + i
        steps += [engine.forward([Row("long", [token], 1)])[0] for token in tokens[301:]]
        engine.crop("long", 300)
        verified = engine.forward([Row("long", tokens[300:], 4)])[0]
        engine.crop("long", 300)
        beside = engine.forward([Row("short", tokens[:40], 1), Row("long", tokens[300:301], 1)])[1]
        for session_id in ("long", "short"):
            engine.release(session_id)
        return steps, verified, beside

    steps, verified, beside = await on_target_thread(real_stack, score)
    assert torch.equal(verified, torch.cat(steps))
    assert torch.equal(beside, steps[0])


async def test_many_sessions_steps_and_a_verify_in_one_call_score_as_each_alone(real_stack):
    """With scripts/batch_invariant_ggml/'s patches in ggml-cpu (setup.sh builds them in), the target
    takes the first exact setting: repacked weights, up to 63 scored positions a call, where without
    them it scores 3 a call (model/llama_cpp_exactness.py). Then one call of 10 of 13 sessions' decode
    steps and a verify of 4 gives each position bit for bit what it gets alone; the three left out sit
    in gaps of the call's seq ids, which the engine fills with a token each (`_fillers`: one ubatch,
    not several) and removes, so their next steps are what they were too."""
    from specd.model.llama_cpp_exactness import EXACT_SETTINGS, ggml_has_amx

    def score(engine):
        text = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n" * 20
        tokens = engine.tokenizer(text).input_ids[:320]
        ids = [f"s{i}" for i in range(13)]
        for i, session_id in enumerate(ids):  # contexts of 40..76 tokens, each its own
            engine.forward([Row(session_id, tokens[: 40 + 3 * i], 1)])
        engine.forward([Row("verify", tokens[:300], 1)])
        alone = [engine.forward([Row(session_id, [tokens[i]], 1)])[0] for i, session_id in enumerate(ids)]
        alone.append(engine.forward([Row("verify", tokens[300:304], 4)])[0])
        for i, session_id in enumerate(ids):
            engine.crop(session_id, 40 + 3 * i)
        engine.crop("verify", 300)
        out = {3, 7, 8}  # gaps of one and two seq ids
        rows = [Row(session_id, [tokens[i]], 1) for i, session_id in enumerate(ids) if i not in out]
        filled = engine.filled
        together = engine.forward([*rows, Row("verify", tokens[300:304], 4)])
        filled = engine.filled - filled
        after = [engine.forward([Row(ids[i], [tokens[i]], 1)])[0] for i in sorted(out)]
        for session_id in [*ids, "verify"]:
            engine.release(session_id)
        expected = [a for i, a in enumerate(alone[:-1]) if i not in out] + [alone[-1]]
        return (engine.repacked, engine.call_tokens), expected, together, filled, [alone[i] for i in sorted(out)], after

    setting, expected, together, filled, before, after = await on_target_thread(real_stack, score)
    if not ggml_has_amx():
        assert setting == EXACT_SETTINGS[0], f"{setting}: is the patched ggml-cpu installed? (scripts/setup.sh)"
        assert filled == 3
    assert all(torch.equal(a, b) for a, b in zip(expected, together)), "a row scores otherwise beside others"
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a filled gap changed a session's cache"


async def test_a_transformers_draft_serves_a_llama_cpp_target(real_stack, real_baselines, tmp_path):
    """One pair, two engines: the real draft in float32 on the transformers engine (`specd serve draft
    --engine transformers --quantize none`, a process of its own) in front of the llama.cpp target: the tokenizer check
    passes, and the output is the llama.cpp target's."""
    flags = ("--engine", "transformers", "--quantize", "none")  # not int4, a CPU draft's default
    async with real_draft_process(real_stack.services, tmp_path / "draft.log", *flags) as services:
        stack = await stack_over(services)
        try:
            draft_info = await stack.services.draft.Info(common_pb2.InfoRequest())
            target_info = await stack.services.target.Info(common_pb2.InfoRequest())
            assert (draft_info.dtype, target_info.dtype) == ("float32", "gguf")
            assert draft_info.tokenizer_fingerprint == target_info.tokenizer_fingerprint
            for prompt in REAL_PROMPTS:
                request = make_request(prompt, REAL_NEW_TOKENS, draft_tokens=3, ignore_eos=True)
                result = await complete(stack.client, request)
                assert result.token_ids == real_baselines[prompt].token_ids, prompt
                assert result.final.stats.accepted > 0
        finally:
            await stop_stack(stack)


@pytest.fixture
async def fresh_orchestrator(real_stack):
    """An orchestrator of its own over the real services: workers with no costs measured and no α
    learnt from earlier requests, so what the adaptive K chooser does is this test's alone."""
    stack = await stack_over(real_stack.services)
    yield stack
    await stack.channel.close()
    await stack.orchestrator.stop(0)


@pytest.mark.parametrize("drafter, k", [("ngram", None), ("hybrid", None), ("hybrid", 4)])
async def test_an_edit_prompt_is_exact_whoever_guesses(fresh_orchestrator, drafter, k):
    """The first edit prompt (bench/prompts_edit.jsonl: rename in a file given in the prompt): the
    real target repeats the file, the prompt lookup guesses it, and the output is speculation off's."""
    from specd.bench.systems import EDIT_PROMPTS, load_prompts

    prompt = load_prompts(EDIT_PROMPTS)[0][0]
    off = await complete(fresh_orchestrator.client, make_request(prompt, 48, draft_tokens=0, ignore_eos=True))
    run = await complete(
        fresh_orchestrator.client, make_request(prompt, 48, draft_tokens=k, ignore_eos=True, drafter=drafter)
    )
    assert run.token_ids == off.token_ids, (drafter, k)
    stats = run.final.stats
    assert stats.drafter == drafter and stats.lookup_accepted > 0  # the lookup guessed, and rightly
    if drafter == "ngram":
        assert stats.lookup_drafted == stats.drafted


async def test_drafting_ahead_on_the_real_pair_keeps_the_output(real_stack):
    """Draft-ahead forced on (orchestrator/ahead.py), the draft model guessing: the real target's greedy
    output equals speculation off's, and some steps took guesses drafted during the previous verify."""
    prompt = "def quicksort(arr):"
    off = await complete(real_stack.client, make_request(prompt, 32, draft_tokens=0, ignore_eos=True))
    message = make_request(prompt, 32, draft_tokens=4, ignore_eos=True, drafter="model")
    message.draft_ahead = "on"
    run = await complete(real_stack.client, message)
    assert run.token_ids == off.token_ids
    stats = run.final.stats
    assert stats.ahead_steps > 0 and stats.ahead_ready > 0 and stats.accepted > 0


async def test_a_prompt_served_from_the_prefix_cache_gives_the_same_tokens(real_stack):
    """The prefix cache on the real pair (model/prefix_cache.py): a prompt seen before starts from its
    kept head and its last token, with the logits its first pass scored there (so its first token
    costs no pass), under the same cache_salt only, and the greedy output is a fresh prefill's; the
    engine's logits agree bit for bit."""
    from specd.bench.systems import EDIT_PROMPTS, load_prompts

    prompt = load_prompts(EDIT_PROMPTS)[0][0] + "\n# Also keep a docstring.\n"
    target = real_stack.services.target_server.thread.service
    hits = target.prefix_stats().hit_tokens
    runs = []
    for salt, k in [("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 0), ("tenant-a", 0)]:
        message = make_request(prompt, 24, draft_tokens=k, ignore_eos=True)
        message.cache_salt = salt
        runs.append(await complete(real_stack.client, message))
    assert len({tuple(run.token_ids) for run in runs}) == 1
    cached = [run.final.usage.cached_prompt_tokens for run in runs]
    whole = runs[0].final.usage.prompt_tokens
    assert cached == [0, 0, whole, whole], cached  # b never hits a's
    assert target.prefix_stats().hit_tokens - hits >= cached[2] + cached[3]
    assert await on_target_thread(real_stack, lambda engine: restored_as_fresh(engine, prompt, 64))


async def test_a_chats_next_turn_finds_the_last_prompt_and_answer_kept_and_says_the_same(real_stack):
    """Issue 49 on the real pair: the orchestrator's Release hands the services a finished request's
    tokens; where they are a chat's, the target prefills them again in the calls a fresh prefill makes
    and keeps them (SessionStore.keep_answer), so the next turn, sent as text the way a client does,
    takes from the cache its whole history up to its own message, and says what it says with the cache
    off (another salt); restored at a message's end inside a block, the engine's logits are a fresh
    prefill's bit for bit."""
    from specd.bench.chat import render_prompt

    target = real_stack.services.target_server.thread.service
    answers = target.prefix_stats().answers
    history: list[tuple[str, str]] = []
    turns = []
    for message in ("Write a Python function that reverses a string.", "Now make it reverse the words."):
        prompt = render_prompt("You are a helpful assistant.", history, message)
        runs = []
        for salt in ("chat", f"nothing held for {len(history)}"):
            runs.append(await complete(real_stack.client, make_request(prompt, 24, cache_salt=salt, ignore_eos=True)))
        assert runs[0].token_ids == runs[1].token_ids
        turns.append(runs[0].final.usage)
        history.append((message, runs[0].text))
    assert target.prefix_stats().answers - answers >= 2
    first, second = turns
    # everything turn 1 sent and was answered, up to the end-of-turn token after the answer
    assert second.cached_prompt_tokens >= first.prompt_tokens + 24 - 1, (first, second)
    prompt = render_prompt("You are a helpful assistant.", history, "And in C?")
    tokens = target.engine.tokenizer(prompt).input_ids
    end = tokens.index(target.engine.description.eos_token_ids[0], 70)  # the end of a message, inside a block
    assert end % 64 and await on_target_thread(real_stack, lambda engine: restored_as_fresh(engine, prompt, end))


def restored_as_fresh(engine, prompt: str, length: int) -> bool:
    """Whether the prompt's last logits, restored from a copy of its prefill cut to `length` tokens,
    are a fresh prefill's bit for bit."""
    tokens = engine.tokenizer(prompt).input_ids
    fresh = engine.forward([Row("fresh", tokens, 1)])[0]
    engine.restore("resumed", engine.snapshot("fresh", engine.reusable("fresh")), length)
    try:
        return torch.equal(fresh, engine.forward([Row("resumed", tokens[length:], 1)])[0])
    finally:
        for session_id in ("fresh", "resumed"):
            engine.release(session_id)
