"""Prompt lookup (orchestrator/lookup.py) on hand-built sequences, and how the chooser prices its guesses."""

import numpy as np
import pytest
import torch

from specd.model.acceptance import accept_draft
from specd.model.sampling import Sampling
from specd.orchestrator.adaptive import PROBE_MAX_STEPS, PROBE_MIN_STEPS, AdaptiveK, ServiceCosts
from specd.orchestrator.lookup import PromptLookup


def lookup(tokens: list[int], **ngrams) -> PromptLookup:
    index = PromptLookup(**ngrams)
    index.extend(tokens)
    return index


def test_a_repeat_is_found_and_its_continuation_proposed():
    #        0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6]  # ends in (5, 6), seen at 0..1, followed by 7 8 9
    assert lookup(tokens).propose(3) == [7, 8, 9]
    assert lookup(tokens).propose(10) == [7, 8, 9, 1, 2, 5, 6]  # as far as the text goes


def test_nothing_is_proposed_without_an_earlier_match():
    assert lookup([1, 2, 3, 4, 5]).propose(4) == []
    assert lookup([1, 2, 1, 3]).propose(4) == []  # (1, 3) never occurred; one token (3) is no match
    assert lookup([]).propose(4) == [] and lookup([7]).propose(4) == []


def test_the_context_is_never_its_own_match():
    """The last n-gram is indexed only once a token follows it."""
    index = lookup([1, 2])
    assert index.propose(2) == []
    index.extend([3, 1, 2])
    assert index.propose(2) == [3, 1]


def test_the_longest_ngram_wins_over_a_later_shorter_one():
    # (3, 4) occurs last at 6..7 (followed by 0), but (2, 3, 4) only at 1..3 (followed by 9)
    tokens = [1, 2, 3, 4, 9, 8, 3, 4, 0, 2, 3, 4]
    assert lookup(tokens).propose(1) == [9]
    assert lookup(tokens, max_ngram=2).propose(1) == [0]  # at most pairs: the latest pair wins


def test_among_equal_matches_the_latest_wins():
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert lookup(tokens).propose(1) == [8]


def test_overlapping_matches_continue_a_period():
    """A run such as a b a b a: the match overlaps the context's own tail, and its continuation
    goes on with the period."""
    assert lookup([1, 2, 1, 2, 1]).propose(4) == [2, 1]
    assert lookup([4, 4, 4, 4]).propose(3) == [4]


def test_extending_bit_by_bit_equals_indexing_at_once():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, size=300).tolist()
    whole, grown = lookup(tokens), PromptLookup()
    for start in range(0, len(tokens), 7):
        grown.extend(tokens[start : start + 7])
    assert grown.ends == whole.ends and grown.propose(8) == whole.propose(8)


def measured(decode: float, verify_per_token: float, draft: float = 0.05, alpha: float = 0.7) -> ServiceCosts:
    """A worker that has measured a decode, verifies of K = 1..8 (decode + K·verify_per_token) and the draft."""
    costs = ServiceCosts(probe_budget=float("inf"))
    costs.record_verify(0, decode, 0.0)
    for k in range(1, 9):
        costs.record_verify(k, decode + k * verify_per_token, 0.0)
    costs.record_draft(1, draft, 0.0)
    costs.alpha.value = alpha
    return costs


def chooser(costs: ServiceCosts, lookup_alpha: float, alpha: float | None = None) -> AdaptiveK:
    chosen = AdaptiveK(costs, 8)
    chosen.lookup_alpha.value = lookup_alpha
    if alpha is not None:
        chosen.alpha.value = alpha
    return chosen


def test_a_confident_lookup_takes_a_long_guess_and_beats_the_model():
    """Guesses that cost no draft time: with verify cheap and the lookup's α high, all of them."""
    costs = measured(decode=0.1, verify_per_token=0.005)
    assert chooser(costs, lookup_alpha=0.9).lookup_k(100, found=8) == 8
    assert chooser(costs, lookup_alpha=0.9).lookup_k(100, found=3) == 3  # no more than it found
    assert chooser(costs, lookup_alpha=0.9).lookup_k(3, found=8) == 2  # nor past the tokens left, less one


def test_a_lookup_that_keeps_failing_yields_to_the_model():
    costs = measured(decode=0.1, verify_per_token=0.002, draft=0.01, alpha=0.8)
    assert chooser(costs, lookup_alpha=0.05).lookup_k(100, found=8) == 0
    assert chooser(costs, lookup_alpha=0.05).lookup_k(100, found=8, model=False) >= 1  # ngram only: better than off


def test_where_verifying_is_costly_only_a_confident_lookup_pays():
    """llama.cpp on an AVX2 CPU: each verified token costs 0.6 of a decode. A poor lookup then
    loses to target-only, a near-sure one still pays."""
    costs = measured(decode=0.1, verify_per_token=0.06, draft=0.05, alpha=0.3)
    assert chooser(costs, lookup_alpha=0.3).lookup_k(100, found=8, model=False) == 0
    assert chooser(costs, lookup_alpha=0.95).lookup_k(100, found=8, model=False) >= 1


def test_a_lookup_passed_over_for_target_only_is_probed_now_and_then():
    """llama.cpp on a CPU (each verified token 0.6 of a decode): at a low α the lookup loses to
    target-only, but a guess every few steps (the model's probe schedule, doubling while they fail)
    keeps its α current; a kept guess looks again soon, and enough of them turn it on."""
    costs = measured(decode=0.1, verify_per_token=0.06, draft=0.05, alpha=0.3)
    chosen = chooser(costs, lookup_alpha=0.5)
    assert [chosen.lookup_k(100, found=8) for _ in range(PROBE_MIN_STEPS)] == [0] * (PROBE_MIN_STEPS - 1) + [1]
    chosen.observe(1, 0, lookup=True)  # the probe failed: wait twice as long
    waits = [chosen.lookup_k(100, found=8) for _ in range(2 * PROBE_MIN_STEPS)]
    assert waits == [0] * (2 * PROBE_MIN_STEPS - 1) + [1]
    chosen.observe(1, 1, lookup=True)  # kept
    assert [chosen.lookup_k(100, found=8) for _ in range(PROBE_MIN_STEPS)][-1] == 1
    for _ in range(8):
        chosen.observe(1, 1, lookup=True)
    assert chosen.lookup_k(100, found=8) >= 1  # confident now: chosen outright
    # Where the draft model beats target-only, the model's guesses go on: no lookup probes.
    model_wins = chooser(measured(decode=0.1, verify_per_token=0.002, draft=0.01, alpha=0.8), lookup_alpha=0.05)
    assert [model_wins.lookup_k(100, found=8) for _ in range(3 * PROBE_MAX_STEPS)] == [0] * (3 * PROBE_MAX_STEPS)


def test_lookup_and_model_learn_their_own_alpha():
    costs = measured(decode=0.1, verify_per_token=0.005)
    chosen = chooser(costs, lookup_alpha=0.5, alpha=0.5)
    chosen.observe(4, 4, lookup=True)
    assert chosen.lookup_alpha.value > 0.5 and chosen.alpha.value == 0.5
    chosen.observe(4, 0)
    assert chosen.alpha.value < 0.5 and chosen.lookup_alpha.value > 0.5
    assert costs.lookup_alpha.value > 0.5  # the worker's: it seeds the next request


def test_a_fresh_worker_prices_nothing_before_a_decode():
    assert chooser(ServiceCosts(), lookup_alpha=0.9).lookup_k(100, found=8) == 0


@pytest.mark.parametrize("guess", [0, 1, 2, 3])
def test_a_deterministic_guess_with_one_hot_q_leaves_the_output_following_p(guess):
    """The lookup's guess is not drawn from anything: q is one-hot at it. 20,000 steps (K=1) of the
    acceptance rule: the first emitted token must still follow p."""
    p = [0.1, 0.2, 0.3, 0.4]
    p_rows = torch.tensor([p, [0.25] * 4])
    q = torch.zeros(1, 4)
    q[0, guess] = 1.0
    draws = 20_000
    counts = np.zeros(4)
    for seed in range(draws):
        counts[accept_draft([guess], p_rows, q, Sampling(1.0, seed=seed), first_position=3).emitted[0]] += 1
    total_variation = 0.5 * np.abs(counts / draws - np.array(p)).sum()
    assert total_variation < 0.015, (counts / draws, p)
