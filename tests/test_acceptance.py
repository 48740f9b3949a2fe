"""The acceptance rule alone: hand-built cases, determinism, and the distribution it emits."""

import numpy as np
import pytest
import torch

from specd.model.acceptance import accept_draft
from specd.model.sampling import Sampling, probs_from_logits

GREEDY = Sampling()


def one_hot_rows(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """Target scores whose argmax at row i is tokens[i]."""
    rows = torch.zeros(len(tokens), vocab)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return rows


def test_greedy_perfect_match_keeps_all_and_adds_bonus():
    verdict = accept_draft([3, 1, 4], one_hot_rows([3, 1, 4, 7]), None, GREEDY, first_position=10)
    assert verdict.accepted == 3
    assert verdict.emitted == [3, 1, 4, 7]  # 7 is the bonus token: p's choice after all K


def test_greedy_early_mismatch_keeps_prefix_and_recovers():
    # "the cat sat on" vs the target's "the cat lay": keep "the cat", add "lay".
    verdict = accept_draft([0, 1, 2, 3], one_hot_rows([0, 1, 5, 6, 7]), None, GREEDY, first_position=0)
    assert verdict.accepted == 2
    assert verdict.emitted == [0, 1, 5]


def test_greedy_all_rejected_still_emits_one_token():
    verdict = accept_draft([2, 2], one_hot_rows([6, 2, 2]), None, GREEDY, first_position=0)
    assert verdict.accepted == 0
    assert verdict.emitted == [6]


def test_greedy_k1():
    assert accept_draft([4], one_hot_rows([4, 0]), None, GREEDY, 0).emitted == [4, 0]
    assert accept_draft([4], one_hot_rows([5, 0]), None, GREEDY, 0).emitted == [5]


def test_greedy_no_drafts_is_a_plain_decode_step():
    verdict = accept_draft([], one_hot_rows([6]), None, GREEDY, 0)
    assert (verdict.accepted, verdict.emitted) == (0, [6])


def test_sampled_draft_where_p_dominates_q_is_always_accepted():
    # p(x) >= q(x) at the drafted token: min(1, p/q) = 1 whatever the coin says.
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.6, 0.2]])
    for seed in range(50):
        verdict = accept_draft([0, 1], p, q, Sampling(temperature=1.0, seed=seed), 0)
        assert verdict.accepted == 2 and verdict.emitted[:2] == [0, 1]


def test_sampled_draft_the_target_never_emits_is_always_rejected_and_recovered_from_the_residual():
    p = torch.tensor([[0.0, 0.5, 0.5], [0.3, 0.3, 0.4]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for seed in range(50):
        verdict = accept_draft([0], p, q, Sampling(temperature=1.0, seed=seed), 0)
        assert verdict.accepted == 0 and verdict.emitted[0] in (1, 2)


def test_sampling_is_deterministic_in_seed_and_position():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 50, generator=gen), -1)
    q = torch.softmax(torch.randn(4, 50, generator=gen), -1)
    drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(4)]
    runs = {tuple(accept_draft(drafts, p, q, Sampling(1.0, seed=7), 100).emitted) for _ in range(5)}
    assert len(runs) == 1
    by_seed = {tuple(accept_draft(drafts, p, q, Sampling(1.0, seed=s), 100).emitted) for s in range(40)}
    assert len(by_seed) > 1  # the seed matters


@pytest.mark.parametrize(
    "p, q",
    [
        ([0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]),  # reversed
        ([0.05, 0.05, 0.1, 0.8], [0.25, 0.25, 0.25, 0.25]),  # q flat, p peaked
        ([0.97, 0.01, 0.01, 0.01], [0.01, 0.01, 0.01, 0.97]),  # q far from p
        ([0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]),  # q == p
        ([0.0, 0.5, 0.5, 0.0], [0.5, 0.0, 0.0, 0.5]),  # disjoint supports
    ],
)
def test_emitted_first_token_follows_p(p, q):
    """20,000 draws of one speculative step (K=1): the first emitted token must follow p."""
    p_row, q_row = torch.tensor([p]), torch.tensor([q])
    p_rows = torch.cat([p_row, torch.full((1, 4), 0.25)])  # the bonus row: any distribution
    rng = np.random.default_rng(1)
    draws = 20_000
    counts = np.zeros(4)
    for seed in range(draws):
        draft = int(rng.choice(4, p=q_row[0].numpy() / q_row[0].numpy().sum()))
        verdict = accept_draft([draft], p_rows, q_row, Sampling(1.0, seed=seed), first_position=3)
        counts[verdict.emitted[0]] += 1
    observed = counts / draws
    total_variation = 0.5 * np.abs(observed - np.array(p)).sum()
    assert total_variation < 0.015, (observed, p)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (probs_from_logits(logits, Sampling(1.0, top_k=2)) > 0).sum() == 2
    nucleus = probs_from_logits(logits, Sampling(1.0, top_p=0.5))
    assert (nucleus > 0).sum() == 1 and torch.isclose(nucleus.sum(), torch.tensor(1.0))
    assert torch.allclose(probs_from_logits(logits, Sampling(1.0)).sum(), torch.tensor(1.0))
