"""The prefix cache (model/prefix_cache.py) and the session store's use of it (model/sessions.py):
whole-block hits under a salt, leaves only, least recently used out under the budget; a session
started from a kept prefix scores bit for bit as a fresh prefill on the llama.cpp engine."""

from dataclasses import dataclass

import pytest
import torch

from specd.model.engine import Row
from specd.model.loading import load_engine
from specd.model.prefix_cache import BLOCK_TOKENS, PrefixCache
from specd.model.sessions import Cursor, SessionStore
from specd.proto.limits import Limits

B = BLOCK_TOKENS


@dataclass
class Copy:
    nbytes: int
    held_tokens: int = 0  # the KV positions it holds; 0: just the entry's tokens


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 13 * i) % 5000 + 100 for i in range(n)]


def test_a_lookup_finds_the_longest_whole_block_prefix_under_its_salt_only():
    cache = PrefixCache(budget_tokens=10 * B)
    prompt = tokens(1, 3 * B + 5)
    cache.insert("", prompt[: 3 * B], Copy(100))
    entry, length = cache.lookup("", prompt[: 2 * B + 7] + [1, 2, 3], most=10 * B)
    assert entry is not None and length == 2 * B  # whole blocks only
    assert cache.lookup("", prompt, most=3 * B - 1)[1] == 2 * B  # never past `most`
    assert cache.lookup("tenant", prompt, most=10 * B) == (None, 0)  # another salt sees nothing
    assert cache.lookup("", tokens(2, 3 * B), most=10 * B) == (None, 0)
    other = prompt[:B] + tokens(3, 2 * B)  # the first block shared, the second not
    assert cache.lookup("", other, most=10 * B)[1] == B


def test_a_hash_collision_serves_neither_other_tokens_nor_another_tenants_prefix(monkeypatch):
    """The chain's digests collide (forced: one digest per depth, whatever the salt and the tokens):
    the lookup checks the entry's own salt and tokens, and finds nothing."""
    from specd.model import prefix_cache

    monkeypatch.setattr(prefix_cache, "chain_hashes", lambda salt, tokens, blocks: [bytes([d]) for d in range(blocks)])
    cache = PrefixCache(budget_tokens=10 * B)
    prompt = tokens(1, 2 * B)
    cache.insert("tenant-a", prompt, Copy(100))
    assert cache.lookup("tenant-a", prompt, most=2 * B)[1] == 2 * B
    assert cache.lookup("tenant-b", prompt, most=2 * B) == (None, 0)  # the same tokens, another tenant
    assert cache.lookup("tenant-a", tokens(2, 2 * B), most=2 * B) == (None, 0)  # other tokens


def test_the_first_token_logits_are_found_for_the_very_prompt_and_kept_by_the_newest_entries_only():
    """Entry.first: a prompt of exactly the head and that token finds it; another last token, a longer
    or a shorter prompt, or another salt does not; past FIRSTS_MOST the least recently used entries
    give theirs up (each holds a vocabulary of float32)."""
    from specd.model.prefix_cache import FIRSTS_MOST

    cache = PrefixCache(budget_tokens=1000 * B)
    prompts = [tokens(500 + index, 20) for index in range(FIRSTS_MOST + 1)]
    for prompt in prompts:
        cache.insert("", prompt[:-1], Copy(10), (prompt[-1], f"logits of {prompt[-1]}"))
    first = prompts[-1]
    assert cache.first_for("", first).first == (first[-1], f"logits of {first[-1]}")
    for other in (first[:-1] + [first[-1] + 1], first + [7], first[:-1]):
        assert cache.first_for("", other) is None
    assert cache.first_for("tenant", first) is None
    held = list(cache.entries.values())  # least recently used first
    assert len(held) == len(prompts) and held[0].first is None  # its head still held, its logits given up
    assert sum(entry.first is not None for entry in held) == FIRSTS_MOST


def test_only_leaves_are_kept_a_longer_prefix_replaces_the_one_it_extends():
    cache = PrefixCache(budget_tokens=10 * B)
    chat = tokens(4, 5 * B)
    cache.insert("", chat[: 2 * B], Copy(10))
    assert cache.wants("", chat[: 2 * B]) == 0  # held already
    assert cache.wants("", chat[: 4 * B + 3]) == 4 * B + 3  # a head: its blocks and its tail
    cache.insert("", chat[: 4 * B], Copy(20))
    stats = cache.stats()
    assert (stats.entries, stats.blocks, stats.tokens, stats.bytes, stats.evictions) == (1, 4, 4 * B, 20, 0)
    assert cache.lookup("", chat, most=5 * B)[1] == 4 * B
    cache.insert("x", chat[: 2 * B], Copy(10))  # the same tokens under another salt: an entry of its own
    assert cache.stats().entries == 2


def test_another_question_after_the_same_context_replaces_the_last_one_only_in_its_last_block():
    """Many users over one system prompt: each request's head is the context and its own question.
    The store keeps one copy of the context, not one per request: an entry that parts from a new one
    only in its last whole block and tail is dropped for it (its prompt again finds all but that block)."""
    cache = PrefixCache(budget_tokens=20 * B)
    context = tokens(5, 4 * B - 10)  # the questions start 10 tokens before the end of block 4
    first, second = context + tokens(6, 40), context + tokens(7, 40)
    cache.insert("", first, Copy(10))
    cache.insert("", second, Copy(10))
    assert cache.stats().entries == 1 and cache.lookup("", second, most=len(second))[1] == len(second)
    assert cache.lookup("", first, most=len(first))[1] == 3 * B  # the context's whole blocks
    elsewhere = context[: 2 * B] + tokens(8, 3 * B)  # parts two blocks before its end: both kept
    cache.insert("", elsewhere, Copy(10))
    assert cache.stats().entries == 2 and cache.lookup("", second, most=len(second))[1] == len(second)


def test_a_head_that_ends_inside_a_block_is_found_whole_and_only_as_itself():
    """Issue 49, short prompts: the tail after a head's last whole block is restorable only by a call
    whose head is exactly those tokens (a fresh prefill of it makes the same last call); under a
    block there is nothing else to find."""
    cache = PrefixCache(budget_tokens=10 * B)
    prompt = tokens(40, B + 10)
    cache.insert("", prompt, Copy(10))
    assert cache.lookup("", prompt + [7], most=B + 10)[1] == B + 10
    assert cache.lookup("", prompt + [7, 8], most=B + 11)[1] == B  # a longer head: the block only
    assert cache.lookup("", prompt, most=B + 9)[1] == B  # a shorter one: the block only
    assert cache.lookup("", prompt[:B] + tokens(41, 10), most=B + 10)[1] == B  # another tail
    short = tokens(42, 20)
    cache.insert("", short, Copy(10))
    assert cache.lookup("", short + [7], most=20)[1] == 20
    assert cache.lookup("", short, most=19) == (None, 0)
    assert cache.lookup("tenant", short + [7], most=20) == (None, 0)
    assert cache.wants("", short) == 0 and cache.wants("", short + [7]) == 21
    longer = prompt + [7]  # a longer tail, no cut where the shorter ends: it stays, the next to be evicted
    cache.insert("", longer, Copy(10))
    assert next(iter(cache.entries.values())).tokens == tuple(prompt) and cache.stats().entries == 3
    assert cache.lookup("", prompt + [7], most=B + 10)[1] == B + 10
    assert cache.lookup("", longer + [9], most=B + 11)[1] == B + 11 and cache.stats().blocks == 2
    # An entry under a block is found by its head alone: one that a longer entry starts with stays
    # until the budget evicts it (still serving its own head), as finding it would cost a hash a length.


def test_the_least_recently_used_entry_goes_first_and_the_budget_holds():
    cache = PrefixCache(budget_tokens=2 * B)
    first, second, third = tokens(5, B), tokens(6, B), tokens(7, B)
    cache.insert("", first, Copy(1))
    cache.insert("", second, Copy(1))
    assert cache.lookup("", first + [9], most=B)[1] == B  # first is now the most recently used
    cache.insert("", third, Copy(1))
    assert cache.lookup("", second, most=B) == (None, 0)
    assert cache.lookup("", first, most=B)[1] == cache.lookup("", third, most=B)[1] == B
    assert cache.stats().evictions == 1 and cache.tokens <= cache.budget_tokens
    assert cache.clear() == 2 and cache.stats().tokens == cache.stats().bytes == 0


def test_a_copy_holding_more_than_its_prefix_counts_it_all_against_the_budget():
    """Issue 49 (4): a llama.cpp copy is its whole sequence (the prompt's partial block, a verify's
    drafts); the budget counts what the copies hold, the blocks what they may restore."""
    cache = PrefixCache(budget_tokens=4 * B)
    cache.insert("", tokens(30, 2 * B), Copy(10, held_tokens=3 * B - 5))
    stats = cache.stats()
    assert (stats.tokens, stats.blocks, stats.entries) == (3 * B - 5, 2, 1)
    cache.insert("", tokens(31, B), Copy(10))  # 4 B - 5 held: within the budget
    assert cache.stats().entries == 2 and cache.stats().evictions == 0
    cache.insert("", tokens(32, B), Copy(10))  # 5 B - 5: the least recently used goes
    assert cache.lookup("", tokens(30, 2 * B), most=2 * B) == (None, 0)
    assert (cache.stats().tokens, cache.stats().blocks, cache.stats().evictions) == (2 * B, 2, 1)


def test_a_budget_under_one_block_turns_the_store_off():
    cache = PrefixCache(budget_tokens=0)
    assert not cache.enabled and cache.wants("", tokens(8, 4 * B)) == 0
    assert cache.lookup("", tokens(8, 4 * B), most=4 * B) == (None, 0)


# -- the session store over the llama.cpp engine (the tiny float32 GGUF) -------------------------


@pytest.fixture(scope="module")
def llama(tiny_gguf):
    limits = Limits(max_sessions=8, max_session_tokens=1024, max_cached_tokens=8 * 1024)
    return load_engine("target", str(tiny_gguf["target"]), engine="llama.cpp", limits=limits)


def store(engine, budget: int) -> SessionStore:
    return SessionStore(engine, Limits(max_sessions=8, max_session_tokens=1024, prefix_cache_tokens=budget))


def opening(store: SessionStore, session_id: str, prompt: list[int], salt: str = "") -> torch.Tensor:
    """A request's first call: a cursor from token 0 carrying the whole prompt, logits of its last."""
    store.sync(Cursor(session_id, 0, 0, prompt, salt))
    return store.forward([Row(session_id, prompt, 1)])[0]


def test_the_engine_checks_at_load_that_a_restored_prefix_is_exact(llama):
    assert llama.prefixes_exact


def test_a_session_from_a_kept_prefix_scores_bit_for_bit_as_a_fresh_prefill(llama):
    cached, fresh = store(llama, 4096), store(llama, 0)
    system = tokens(9, 3 * B + 10)
    opening(cached, "first", system + tokens(10, 20))
    stats = cached.prefix.stats()  # three blocks to restore; the copy holds the whole sequence
    assert cached.sessions["first"].reused == 0 and (stats.blocks, stats.tokens) == (3, len(system) + 20)
    cached.release("first")
    for turn, tail in enumerate([tokens(11, 30), tokens(12, B + 3), tokens(13, 1)]):
        prompt = system + tail
        # what the scheduler prices the opening call at: the prompt less what it restores (model/scheduler.py)
        assert cached.opening_prefix(Cursor("asked", 0, 0, prompt))[1] == 3 * B
        assert cached.opening_prefix(Cursor("asked", 0, 0, prompt, "tenant"))[1] == 0
        logits = opening(cached, f"hit{turn}", prompt)
        assert cached.sessions[f"hit{turn}"].reused == 3 * B
        assert torch.equal(logits, opening(fresh, f"fresh{turn}", prompt))
        steps = [[5], [6, 7, 8]]  # then decode and verify after it, as a request would
        for step in steps:
            ahead = cached.forward([Row(f"hit{turn}", step, len(step))])[0]
            assert torch.equal(ahead, fresh.forward([Row(f"fresh{turn}", step, len(step))])[0])
        cached.release(f"hit{turn}")
        fresh.release(f"fresh{turn}")
    stats = cached.prefix.stats()
    assert stats.hit_tokens == 3 * 3 * B and stats.miss_tokens > 0


def test_the_same_short_prompt_again_takes_even_its_first_token_from_the_store_bit_for_bit(llama, monkeypatch):
    """Issue 49, short prompts: a prompt under a block, sent again, restores every token, its last
    too, with the logits its first pass scored there (issue 50: the llama.cpp engine scores a position
    alike in any pass), so the engine computes nothing for it; those logits and the steps after them
    are bit for bit a fresh prefill's. An opening Verify (drafts after the prompt) computes only its
    drafts. A prompt that only starts with it finds nothing: its prefill's last call would be another;
    one that differs in its last token restores the head and scores its own."""
    cached, fresh = store(llama, 4096), store(llama, 0)
    assert cached.scores_from_cache and not fresh.scores_from_cache
    prompt = tokens(43, 30)
    opening(cached, "first", prompt)
    cached.release("first")
    computed = []
    forward = llama.forward
    monkeypatch.setattr(llama, "forward", lambda rows: computed.append([len(r.tokens) for r in rows]) or forward(rows))
    calls = (  # session, its cursor's tokens, its first row, the logits it keeps, tokens restored, computed
        ("again", prompt, prompt, 1, len(prompt), 0),
        ("verify", prompt, prompt + [5, 6, 7], 4, len(prompt), 3),
        ("longer", prompt + [9], prompt + [9], 1, 0, len(prompt) + 1),
        ("other last", prompt[:-1] + [9], prompt[:-1] + [9], 1, len(prompt) - 1, 1),
    )
    for session_id, cursor, row, keep, reused, tokens_computed in calls:
        cached.sync(Cursor(session_id, 0, 0, cursor))
        computed.clear()
        logits = cached.forward([Row(session_id, row, keep)])[0]
        assert computed == [[tokens_computed]], session_id
        fresh.sync(Cursor(f"fresh {session_id}", 0, 0, cursor))  # both stores share the engine
        assert torch.equal(logits, fresh.forward([Row(f"fresh {session_id}", row, keep)])[0])
        assert cached.sessions[session_id].reused == reused
        for step in ([5], [6, 7, 8]):
            ahead = cached.forward([Row(session_id, step, len(step))])[0]
            assert torch.equal(ahead, fresh.forward([Row(f"fresh {session_id}", step, len(step))])[0])
        cached.release(session_id)
        fresh.release(f"fresh {session_id}")
    assert cached.prefix.stats().hit_tokens == 2 * len(prompt) + len(prompt) - 1
    # A call that scores nothing there (a Prefill of the whole prompt) does not take that scored
    # position as if prefilled: it restores the head and computes the last token itself, as before.
    cached.sync(Cursor("prefill", 0, 0, prompt))
    computed.clear()
    assert cached.forward([Row("prefill", prompt, 0)])[0].shape[0] == 0
    assert computed == [[1]] and cached.sessions["prefill"].reused == len(prompt) - 1
    assert cached.sessions["prefill"].tokens == prompt
    cached.release("prefill")
    assert cached.prefix.stats().hit_tokens == 2 * len(prompt) + 2 * (len(prompt) - 1)


def test_a_salt_keeps_one_tenants_prefixes_from_another(llama):
    cached = store(llama, 4096)
    prompt = tokens(14, 2 * B + 9)
    opening(cached, "a1", prompt, salt="tenant-a")
    opening(cached, "b", prompt, salt="tenant-b")
    assert cached.sessions["b"].reused == 0  # never a block of tenant a's
    opening(cached, "a2", prompt, salt="tenant-a")
    assert cached.sessions["a2"].reused == len(prompt)  # the same salt shares: the same prompt whole
    opening(cached, "none", prompt)
    assert cached.sessions["none"].reused == 0  # no salt: the shared pool, which holds nothing yet
    for session_id in list(cached.sessions):
        cached.release(session_id)


def test_a_call_that_wants_logits_for_the_kept_prefix_computes_them(llama):
    """Prompt log-probabilities keep a row of logits per prompt token: the store gives the prefix back."""
    cached, fresh = store(llama, 4096), store(llama, 0)
    prompt = tokens(15, 2 * B + 4)
    opening(cached, "seed", prompt)
    for keep, reused in ((len(prompt), 0), (3, 2 * B)):  # every row; the last 3, inside the restored tail
        cached.sync(Cursor("all", 0, 0, prompt))
        assert cached.sessions["all"].reused == len(prompt)  # its last token too, with the logits scored there
        kept = cached.forward([Row("all", prompt, keep)])[0]
        fresh.sync(Cursor("all", 0, 0, prompt))
        assert torch.equal(kept, fresh.forward([Row("all", prompt, keep)])[0])
        # given back to whole blocks: the tail is exact only as the head it was prefilled as
        assert cached.sessions["all"].reused == reused and len(cached.sessions["all"].tokens) == len(prompt)
        cached.release("all")
        fresh.release("all")
    cached.release("seed")


def test_many_conversations_over_a_small_budget_evict_and_never_fail(llama):
    cached = store(llama, 4 * (2 * B + 5))  # holds four prompts of two blocks and 5 tokens (copied whole)
    for index in range(16):
        opening(cached, f"c{index}", tokens(100 + index, 2 * B + 5))
        cached.release(f"c{index}")
        assert cached.prefix.tokens <= cached.prefix.budget_tokens
    stats = cached.prefix.stats()
    assert stats.entries == 4 and stats.evictions == 12 and stats.hit_tokens == 0
    opening(cached, "again", tokens(115, 2 * B + 5))  # the last one is still held
    assert cached.sessions["again"].reused == 2 * B + 5  # all of it, its last token with the logits scored there
    cached.release("again")


def test_after_a_failed_opening_pass_a_call_from_token_0_computes_every_token(llama, monkeypatch):
    """Issue 49 (1): a session opened from a kept prefix whose opening pass fails holds the restored
    tokens and would skip them in its next row; the next call from token 0 (the draft resends its
    Propose from 0) rolls back to 0, restores the prefix anew and computes the rest, bit for bit as a
    fresh prefill."""
    cached, fresh = store(llama, 4096), store(llama, 0)
    prompt = tokens(16, 2 * B + 6)
    opening(cached, "seed", prompt)
    cached.sync(Cursor("again", 0, 0, prompt))
    assert cached.sessions["again"].skip == len(prompt)  # its last token too, with its logits
    with monkeypatch.context() as failing:
        failing.setattr(llama, "forward", lambda rows: (_ for _ in ()).throw(RuntimeError("a pass failed")))
        with pytest.raises(RuntimeError):
            cached.forward([Row("again", prompt, 1)])
    cached.sync(Cursor("again", 0, 0, prompt))  # the retry, from token 0
    session = cached.sessions["again"]
    assert (session.skip, session.reused, session.tokens) == (len(prompt), len(prompt), prompt)  # restored anew
    logits = cached.forward([Row("again", prompt, 1)])[0]
    assert torch.equal(logits, opening(fresh, "fresh", prompt)) and session.tokens == prompt
    for session_id in ("seed", "again"):
        cached.release(session_id)
    fresh.release("fresh")


def test_a_live_session_prefilled_again_from_token_0_starts_from_the_store(llama):
    """Issue 49 (3): a resync or a reset record sends a live session's tokens from 0 again; that
    prefill looks the store up as an opening call does, reports what it reused, and scores bit for
    bit as a fresh prefill."""
    cached, fresh = store(llama, 4096), store(llama, 0)
    prompt = tokens(18, 2 * B + 5)
    opening(cached, "seed", prompt)
    opening(cached, "live", tokens(19, 40))  # a session with other KV, and decode steps after it
    cached.forward([Row("live", [7], 1)])
    again = prompt + tokens(20, 9)  # its tokens as the orchestrator holds them, from token 0
    cached.sync(Cursor("live", 0, 0, again))
    assert cached.sessions["live"].reused == 2 * B  # what the verifier reports as cached_prompt_tokens
    logits = cached.forward([Row("live", again, 1)])[0]
    assert torch.equal(logits, opening(fresh, "fresh", again))
    assert cached.sessions["live"].tokens == again
    for session_id in ("seed", "live"):
        cached.release(session_id)
    fresh.release("fresh")


def test_a_restore_or_a_snapshot_out_of_memory_never_fails_the_call(llama, monkeypatch):
    """Issue 49 (2): a restore that runs out of memory drops its entry and the call computes the
    prefix itself, bit for bit as a fresh prefill; a snapshot that runs out of memory keeps nothing
    and the call keeps its result. Both are counted."""
    cached, fresh = store(llama, 4096), store(llama, 0)
    prompt = tokens(17, 2 * B + 3)
    opening(cached, "seed", prompt)
    assert cached.prefix.stats().entries == 1
    with monkeypatch.context() as short:
        short.setattr(llama, "restore", lambda *args: (_ for _ in ()).throw(MemoryError("no host memory")))
        logits = opening(cached, "restored", prompt)
    assert torch.equal(logits, opening(fresh, "fresh", prompt))
    session = cached.sessions["restored"]
    assert session.reused == 0 and session.tokens == prompt
    cached.release("seed")
    cached.release("restored")
    stats = cached.prefix.stats()
    assert stats.failures == 1 and stats.hit_tokens == 0 and stats.entries in (0, 1)  # dropped, then kept anew
    cached.prefix.clear()
    with monkeypatch.context() as short:
        short.setattr(llama, "snapshot", lambda *args: (_ for _ in ()).throw(MemoryError("no host memory")))
        logits = opening(cached, "unkept", prompt)
    assert torch.equal(logits, opening(fresh, "fresh again", prompt))
    assert cached.prefix.stats().failures == 2 and cached.prefix.stats().entries == 0
    cached.release("unkept")
    for session_id in ("fresh", "fresh again"):
        fresh.release(session_id)


def test_a_copy_on_llama_cpp_holds_the_whole_sequence_and_is_counted_so(llama):
    cached = store(llama, 4096)
    prompt, drafts = tokens(21, 2 * B + 7), [5, 6, 7]
    cached.sync(Cursor("verify", 0, 0, prompt))
    cached.forward([Row("verify", prompt + drafts, len(drafts) + 1)])  # an opening Verify: logits for the drafts
    stats = cached.prefix.stats()
    assert (stats.entries, stats.blocks, stats.tokens) == (1, 2, len(prompt) + len(drafts))
    cached.release("verify")


def test_out_of_room_the_store_is_emptied_only_where_its_copies_take_the_kvs_memory(llama, monkeypatch):
    """Issue 49 (4): on llama.cpp the KV is allocated at start and the copies sit in host memory:
    emptying the store frees nothing for the pass, so a pass out of room fails as it would without
    the store, and every tenant keeps its prefixes. Where the copies do take that memory (the
    transformers engine on a GPU), the store is emptied and the pass runs once more."""
    from specd.model.errors import CapacityExceeded

    cached = store(llama, 4096)
    opening(cached, "seed", tokens(22, 2 * B + 1))
    cached.sync(Cursor("next", 0, 0, tokens(23, 10)))
    passes = []

    def full_once(rows):
        passes.append(rows)
        if len(passes) == 1:
            raise CapacityExceeded("no KV cell free")
        return real(rows)

    real = llama.forward
    monkeypatch.setattr(llama, "forward", full_once)
    with pytest.raises(CapacityExceeded):
        cached.forward([Row("next", tokens(23, 10), 1)])
    assert cached.prefix.stats().entries == 1 and len(passes) == 1  # kept, and the pass ran once
    passes.clear()
    monkeypatch.setattr(llama, "copies_take_kv_memory", True)
    cached.forward([Row("next", tokens(23, 10), 1)])
    stats = cached.prefix.stats()  # emptied (the seed's two blocks evicted), then the pass ran again
    assert (stats.evictions, stats.blocks, len(passes)) == (1, 0, 2)
    for session_id in ("seed", "next"):
        cached.release(session_id)
