"""Issue 49, a chat's next turn: prefill calls end before every end-of-turn token
(model/prefix_cache.py `prefill_cuts`), so a turn finds the last turn's prompt up to the end of its
last message, not only its whole blocks; and a finished request's answer, kept after its Release
(SessionStore.keep_answer), is found whole. Both bit for bit as a fresh prefill of the turn."""

from dataclasses import dataclass

import test_prefix_cache
import torch
from test_prefix_cache import opening, store, tokens

from specd.model.engine import Row
from specd.model.prefix_cache import BLOCK_TOKENS, PrefixCache, prefill_cuts
from specd.model.sessions import ANSWER_MOST

B = BLOCK_TOKENS
llama = test_prefix_cache.llama  # the fixture: the tiny float32 GGUF on the llama.cpp engine


@dataclass
class Copy:
    nbytes: int = 10
    held_tokens: int = 0


def test_prefill_calls_are_cut_at_every_block_and_before_every_end_of_turn_token():
    eot = 9
    row = [1] * 10 + [eot] + [2] * 70 + [eot]  # appended to a session that holds 60 tokens
    assert prefill_cuts(row, 60, len(row), {eot}) == [0, 4, 10, 68, 81, 82]
    assert prefill_cuts(row, 60, 50, {eot}) == [0, 4, 10, 50]  # the head: the tokens before those scored
    assert prefill_cuts(row, 60, len(row), ()) == [0, 4, 68, 82]  # no end-of-turn tokens: blocks only
    assert prefill_cuts(row, 60, 0, {eot}) == [0]


def test_a_lookup_finds_a_message_end_inside_a_block_and_an_entry_that_ends_where_a_message_does():
    eot = 3
    cache = PrefixCache(budget_tokens=10 * B, boundaries={eot})
    prompt = tokens(50, B + 10) + [eot] + tokens(51, 5)  # a block, a message ending in the next one, more
    cache.insert("", prompt, Copy())
    other = prompt[: B + 10] + [eot] + tokens(52, 30)  # the same message, then another
    assert cache.lookup("", other, len(other) - 1)[1] == B + 10  # up to its end: a cut of both prefills
    assert cache.lookup("", prompt[: B + 10] + tokens(53, 30), B + 39)[1] == B  # no message end: the block
    answered = prompt + [eot] + tokens(54, 9)  # the entry's end, where the new prompt's message ends
    assert cache.lookup("", answered, len(answered) - 1)[1] == len(prompt)
    went_on = prompt + tokens(55, 9)  # the entry's end inside a message: the last cut before it
    assert cache.lookup("", went_on, len(went_on) - 1)[1] == B + 10
    assert cache.lookup("", prompt, len(prompt))[1] == len(prompt)  # exactly its head
    assert cache.lookup("tenant", other, len(other) - 1) == (None, 0)
    short = tokens(56, 12) + [eot] + tokens(57, 4)  # under a block: found from the salt's root
    cache.insert("", short, Copy())
    assert cache.lookup("", short[:13] + tokens(58, 6), 18)[1] == 12
    assert cache.lookup("", tokens(56, 12) + tokens(58, 6), 17) == (None, 0)


def chat_turn(history: list[int], message: int, eot: int) -> list[int]:
    """The history, the end of its last message, a new message, and the start of the answer."""
    return [*history, eot, *tokens(message, 30), eot, *tokens(99, 3)]


def answer(cached, session_id: str, logits: torch.Tensor, n: int) -> list[int]:
    """n greedy decode steps after the opening pass, as a request makes them."""
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = cached.forward([Row(session_id, out[-1:], 1)])[0]
    return out


def test_the_next_turn_finds_the_last_prompt_to_its_last_message_and_the_kept_answer_whole(llama):
    """Turn 2 repeats turn 1's prompt and answer: without the answer kept it takes turn 1's prompt up
    to the end of its last message (not only its whole block); with it kept after turn 1's Release,
    everything before turn 2's own message. Either way its logits, and the decode steps after them,
    are a fresh prefill's bit for bit."""
    eot = llama.description.eos_token_ids[0]
    system = tokens(60, B + 20)
    turn1 = chat_turn(system, 61, eot)
    message_end = len(system) + 1 + 30  # where turn 1's last message ends: the second end-of-turn token
    for keep in (False, True):
        cached, fresh = store(llama, 8192), store(llama, 0)
        said = answer(cached, "t1", opening(cached, "t1", turn1), 12)
        committed = turn1 + said
        cached.release("t1", committed if keep else None)
        assert len(cached.answers) == keep
        cached.keep_answers()
        assert cached.prefix.stats().answers == keep
        turn2 = chat_turn(committed, 62, eot)
        logits = opening(cached, "t2", turn2)
        assert cached.sessions["t2"].reused == (len(committed) if keep else message_end)
        assert torch.equal(logits, opening(fresh, "f2", turn2))
        for step in ([5], [6, 7, 8]):
            ahead = cached.forward([Row("t2", step, len(step))])[0]
            assert torch.equal(ahead, fresh.forward([Row("f2", step, len(step))])[0])
        cached.release("t2")
        fresh.release("f2")


def test_keeping_an_answer_computes_only_what_the_store_lacks_and_never_fails(llama, monkeypatch):
    eot = llama.description.eos_token_ids[0]
    cached = store(llama, 8192)
    turn1 = chat_turn(tokens(70, B + 20), 71, eot)
    said = answer(cached, "t1", opening(cached, "t1", turn1), 6)
    cached.release("t1")
    message_end = B + 20 + 1 + 30
    assert cached.keep_answer("", turn1 + said) == len(turn1) + len(said) - message_end
    assert cached.keep_answer("", turn1 + said) == 0  # held already
    assert cached.keep_answer("", turn1 + said + [eot]) == 0  # an answer that ended on its end-of-turn token
    assert cached.keep_answer("", tokens(72, ANSWER_MOST + 1)) == 0  # nothing held of it: too long to compute
    with monkeypatch.context() as short:
        short.setattr(llama, "restore", lambda *args: (_ for _ in ()).throw(MemoryError("no host memory")))
        assert cached.keep_answer("", turn1 + said + [5, 6]) == 0
    assert cached.prefix.stats().failures == 1 and "\0answer" not in llama.sequences
    raw = tokens(73, 40)  # no end-of-turn token: no conversation to go on with, nothing waits to be kept
    opening(cached, "raw", raw)
    cached.release("raw", raw + [5])
    assert not cached.answers
