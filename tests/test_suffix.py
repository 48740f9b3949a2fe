"""The suffix drafter (orchestrator/suffix.py) on hand-built sequences, over a worker's recent outputs,
and end to end: greedy output is the target's whoever guessed."""

import asyncio
from collections import deque

import numpy as np
from fake_services import POLICY, PROMPT, FakeService, Tokenless, collected, target_only, target_rule
from test_drafters import REPEATS, with_drafter
from test_orchestrator import generate, request

from specd.orchestrator.generation import Generation, GenerationRequest
from specd.orchestrator.lookup import PromptLookup
from specd.orchestrator.suffix import RecentOutputs, SuffixCounts, SuffixDrafter


def drafter(tokens: list[int], recent: RecentOutputs | None = None, **settings) -> SuffixDrafter:
    index = SuffixDrafter(recent, **settings)
    index.extend(tokens)
    return index


def test_a_repeat_is_found_and_its_continuation_proposed():
    #        0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6]  # ends in (5, 6), seen at 0..1, followed by 7 8 9
    assert drafter(tokens).propose(3) == [7, 8, 9]
    assert drafter(tokens).propose(1) == [7]


def test_nothing_is_proposed_without_an_earlier_match():
    assert drafter([1, 2, 3, 4, 5]).propose(4) == []
    assert drafter([1, 2, 1, 3]).propose(4) == []  # (1, 3) never occurred; one token (3) is no match
    assert drafter([]).propose(4) == [] and drafter([7]).propose(4) == []
    assert drafter([5, 6, 7, 5, 6]).propose(0) == []


def test_the_context_is_never_its_own_match():
    index = drafter([1, 2])
    assert index.propose(2) == []
    index.extend([3, 1, 2])
    assert index.propose(2) == [3, 1]


def test_overlapping_matches_continue_the_period():
    """A run such as a b a b a: the match overlaps the context's own tail. Each guess joins the
    context, so unlike the prompt lookup (which copies only as far as the text goes) the guess
    goes on with the period as far as K."""
    assert drafter([1, 2, 1, 2, 1]).propose(5) == [2, 1, 2, 1, 2]
    assert drafter([4, 4, 4, 4]).propose(3) == [4, 4, 4]
    assert _lookup([1, 2, 1, 2, 1]).propose(5) == [2, 1]


def test_the_longest_suffix_wins_over_a_later_shorter_one():
    # (3, 4) occurs last at 6..7 (followed by 0), but (2, 3, 4) only at 1..3 (followed by 9)
    tokens = [1, 2, 3, 4, 9, 8, 3, 4, 0, 2, 3, 4]
    assert drafter(tokens).propose(1) == [9]
    assert drafter(tokens, lengths=(2,)).propose(1) == [0]  # pairs only: (3, 4) -> 9 or 0, the latest


def test_the_more_frequent_continuation_wins_over_the_latest():
    tokens = [1, 2, 7, 3, 1, 2, 7, 4, 1, 2, 8, 5, 1, 2]  # (1, 2) -> 7 twice, then 8 once
    assert drafter(tokens).propose(1) == [7]
    assert _lookup(tokens).propose(1) == [8]  # the prompt lookup takes the latest


def test_among_equally_frequent_continuations_the_latest_wins():
    assert drafter([1, 2, 7, 1, 2, 8, 1, 2]).propose(1) == [8]
    assert drafter([1, 2, 8, 1, 2, 7, 1, 2, 8, 1, 2, 7, 1, 2], lengths=(2,)).propose(1) == [7]  # 8 and 7 twice


def test_confidence_cuts_the_guess_short():
    """(1, 2) -> 7 twice of three (2/3); then (1, 2, 7) -> 3 or 4, once each (1/2): the guess's
    confidence is 2/3 after one token, 1/3 after two, and goes on at 1/3 (each next context was
    followed once)."""
    tokens = [1, 2, 7, 3, 1, 2, 7, 4, 1, 2, 8, 5, 1, 2]
    assert drafter(tokens, min_confidence=0.3).propose(4) == [7, 4, 1, 2]
    assert drafter(tokens, min_confidence=0.5).propose(4) == [7]
    assert drafter(tokens, min_confidence=0.7).propose(4) == []
    assert drafter(tokens, min_confidence=0.0).propose(8) == [7, 4, 1, 2, 8, 5, 1, 2]


def test_extending_bit_by_bit_equals_indexing_at_once():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, size=300).tolist()
    whole, grown = drafter(tokens), SuffixDrafter()
    for start in range(0, len(tokens), 7):
        grown.extend(tokens[start : start + 7])
    assert grown.own.next == whole.own.next and grown.propose(8) == whole.propose(8)


# -- a worker's recent outputs -------------------------------------------------------------------


def recent_outputs(*outputs: list[int], budget: int = 1000) -> RecentOutputs:
    recent = RecentOutputs(budget)
    for output in outputs:
        recent.add(output)
    return recent


def kept(recent: RecentOutputs) -> list[list[int]]:
    return [output for _, output in recent.outputs]


def test_another_requests_output_is_found():
    recent = recent_outputs([20, 21, 22, 23, 24, 25])
    assert drafter([1, 2, 3, 21, 22], recent).propose(3) == [23, 24, 25]
    assert drafter([1, 2, 3, 21, 22]).propose(3) == []  # not in this request's own tokens


def test_this_requests_counts_and_the_recent_ones_add_up():
    recent = recent_outputs([1, 2, 7], [1, 2, 7])
    assert drafter([1, 2, 8, 1, 2], recent).propose(1) == [7]  # 7 twice there beats 8 once here
    assert drafter([1, 2, 8, 1, 2, 8, 1, 2], recent, lengths=(2,)).propose(1) == [8]  # a tie: this request's


def test_the_longest_suffix_wins_across_sources():
    recent = recent_outputs([9, 1, 2, 3, 4])  # (9, 1, 2, 3) -> 4 there
    assert drafter([1, 2, 3, 5, 9, 1, 2, 3], recent).propose(1) == [4]  # beats (1, 2, 3) -> 5 here


def test_the_recent_outputs_stay_within_their_budget_oldest_evicted_first():
    first, second, third = [30, 31, 32, 33], [40, 41, 42, 43], [50, 51, 52, 53]
    recent = recent_outputs(first, second, third, budget=10)
    assert kept(recent) == [second, third] and recent.tokens == 8
    assert drafter([30, 31], recent).propose(2) == []  # evicted: its continuation is no longer guessed
    assert drafter([40, 41], recent).propose(2) == [42, 43]


def test_eviction_removes_exactly_the_evicted_outputs_counts():
    """Outputs that share contexts with the evicted one keep their own counts, no more: the index
    after evictions equals one built from the kept outputs alone."""
    rng = np.random.default_rng(1)
    outputs = [rng.integers(0, 5, size=int(rng.integers(3, 40))).tolist() for _ in range(30)]
    recent = recent_outputs(*outputs, budget=200)
    left = kept(recent)
    assert 0 < len(left) < len(outputs) and recent.tokens <= 200
    assert recent.by_salt[""].next == recent_outputs(*left).by_salt[""].next
    for output in left:
        recent.by_salt[""].remove(output)
    assert recent.by_salt[""].next == {}


def test_an_output_longer_than_the_budget_keeps_its_tail():
    recent = recent_outputs(list(range(100, 120)), budget=5)
    assert kept(recent) == [list(range(115, 120))] and recent.tokens == 5
    assert drafter([116, 117], recent).propose(3) == [118, 119]
    assert recent_outputs([1, 2], budget=5).tokens == 0  # no context with a token after it


def test_a_tenant_reads_only_its_own_salts_outputs():
    """Issue 49 (5): a salted request's guesses, and so its speed, never depend on another tenant's
    outputs; the unsalted requests share theirs."""
    recent = RecentOutputs(1000)
    recent.add([20, 21, 22, 23, 24], salt="a")
    recent.add([30, 31, 32, 33, 34])
    assert drafter([1, 21, 22], recent, salt="a").propose(2) == [23, 24]
    assert drafter([1, 21, 22], recent, salt="b").propose(2) == []
    assert drafter([1, 21, 22], recent).propose(2) == []  # unsalted: not tenant a's either
    assert drafter([1, 31, 32], recent).propose(2) == [33, 34]
    assert drafter([1, 31, 32], recent, salt="a").propose(2) == []


def test_one_budget_for_every_salt_the_oldest_output_evicted_whoever_wrote_it():
    recent = RecentOutputs(10)
    recent.add([40, 41, 42, 43], salt="a")
    recent.add([50, 51, 52, 53], salt="b")
    recent.add([60, 61, 62, 63], salt="b")
    assert recent.outputs == deque([("b", [50, 51, 52, 53]), ("b", [60, 61, 62, 63])]) and recent.tokens == 8
    assert "a" not in recent.by_salt  # its last output gone: no empty index left behind
    assert drafter([40, 41], recent, salt="a").propose(2) == []
    assert drafter([50, 51], recent, salt="b").propose(2) == [52, 53]


def test_a_context_followed_once_is_stored_as_its_token():
    counts = SuffixCounts((2,))
    counts.add([1, 2, 3])
    assert counts.get((1, 2)) == {3: 1} and list(counts.next.values()) == [3]
    counts.add([1, 2, 3])
    assert counts.get((1, 2)) == {3: 2}
    counts.remove([1, 2, 3])
    assert list(counts.next.values()) == [3]


# -- in a generation loop -------------------------------------------------------------------------


async def run_suffix(recent: RecentOutputs, max_new_tokens: int = 30, salt: str = ""):
    request = GenerationRequest(
        prompt_ids=list(PROMPT),
        max_new_tokens=max_new_tokens,
        draft_tokens=4,
        drafter="suffix",
        ignore_eos=True,
        cache_salt=salt,
    )
    generation = Generation(
        request, FakeService(target_rule), FakeService(target_rule), Tokenless(), set(), POLICY, recent=recent
    )
    tokens, finished = await collected(generation)
    return tokens, finished.stats


async def test_a_finished_requests_output_guides_the_next_request_on_its_worker():
    """The first request's output joins the worker's recent outputs when it ends; a second request
    writing the same finds it there and guesses nearly every token. The target decides either way."""
    recent = RecentOutputs()
    first, first_stats = await run_suffix(recent)
    assert kept(recent) == [first] == [target_only(30)]
    second, second_stats = await run_suffix(recent)
    assert second == first
    assert second_stats.lookup_accepted >= 20 > first_stats.lookup_accepted
    assert second_stats.steps < first_stats.steps and second_stats.drafted == second_stats.lookup_drafted


async def test_another_tenants_output_guides_nothing():
    """The same second request under another cache salt finds nothing of the first's output: it
    drafts from its own tokens alone, as the first did (the same steps), and its output is the same."""
    recent = RecentOutputs()
    first, first_stats = await run_suffix(recent, salt="tenant-a")
    assert kept(recent) == [first] and list(recent.by_salt) == ["tenant-a"]
    second, second_stats = await run_suffix(recent, salt="tenant-b")
    assert second == first
    assert (second_stats.steps, second_stats.lookup_accepted) == (first_stats.steps, first_stats.lookup_accepted)
    third, third_stats = await run_suffix(recent, salt="tenant-a")  # its own tenant's: found
    assert third == first and third_stats.steps < first_stats.steps


# -- end to end on the tiny stack -----------------------------------------------------------------


async def test_greedy_output_with_the_suffix_drafter_is_the_target_s(tiny_stack):
    baseline, _, _ = await generate(tiny_stack.client, request(REPEATS, 0, max_new_tokens=48))
    runs = {
        (drafter, k): generate(tiny_stack.client, with_drafter(request(REPEATS, k, max_new_tokens=48), drafter))
        for drafter in ("suffix", "hybrid")
        for k in (None, 3)
    }
    for (drafter, k), (tokens, _, final) in zip(runs, await asyncio.gather(*runs.values())):
        assert tokens == baseline, (drafter, k)
        assert final.stats.drafter == drafter
        if drafter == "suffix":  # every guess is the suffix drafter's, and text that repeats has some
            assert final.stats.lookup_drafted == final.stats.drafted > 0
            assert final.stats.lookup_steps == final.stats.drafting_steps


async def test_sampled_suffix_guesses_go_to_the_target_with_a_one_hot_q(tiny_stack):
    """top_k = 1: p is one-hot at the target's argmax, so a sampled request must equal greedy's, and
    the one-hot q of each guess keeps exactly the guesses p agrees with."""
    greedy, _, _ = await generate(tiny_stack.client, request(REPEATS, 0, max_new_tokens=40))
    message = with_drafter(request(REPEATS, 3, max_new_tokens=40, temperature=1.0, top_k=1, seed=5), "suffix")
    tokens, _, final = await generate(tiny_stack.client, message)
    assert tokens == greedy
    assert final.stats.lookup_drafted == final.stats.drafted and final.stats.lookup_accepted == final.stats.accepted > 0


def _lookup(tokens: list[int]) -> PromptLookup:
    index = PromptLookup()
    index.extend(tokens)
    return index
