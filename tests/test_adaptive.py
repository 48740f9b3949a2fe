"""The K chooser (orchestrator/adaptive.py) on synthetic numbers: the analytic optimum, the off-switch and its recovery.

Costs are in units of one target step (t_verify = 1 for every K: the textbook premise), so
c = t_draft and RTT is per call. Expected K values were worked out by brute force over
E[tokens](K) / (K·c + t_verify + RTT·calls) and spot-checked by hand: α = 0.9, c = 0.4 gives
K = 4 at 1.58× (docs/architecture.md §7's "about 1.6× at K = 4"); α = 0.5, c = 0.4: K = 1 gives 1.5/1.4 =
1.07, K = 2 gives 1.75/1.8 = 0.97; α = 0.3, c = 0.5: K = 1 gives 1.3/1.5 < 1, so off.
"""

import gc

import pytest

from specd.orchestrator.adaptive import (
    ON_MARGIN,
    PROBE_BUDGET,
    PROBE_MAX_STEPS,
    PROBE_MIN_STEPS,
    SHARED_LOAD,
    AdaptiveK,
    Ewma,
    PassCost,
    PassTime,
    ServiceCosts,
    best_draft_length,
    expected_tokens,
    tokens_per_second,
)


def measured_costs(
    t_draft: float, verify: dict[int, float], rtt: float = 0.0, alpha: float = 0.7, probe_budget: float = float("inf")
) -> ServiceCosts:
    """`probe_budget`: by default a worker whose probes are paid for (the schedule is what these test)."""
    costs = ServiceCosts(probe_budget=probe_budget)
    for k, seconds in verify.items():
        costs.record_verify(k, seconds, rtt)
    costs.record_draft(4, 4 * t_draft, rtt)
    costs.alpha = Ewma(costs.alpha.weight, alpha)
    return costs


@pytest.mark.parametrize(
    "alpha, c, rtt, k",
    [
        (0.9, 0.1, 0.0, 8),  # cheap draft, high acceptance: the longest K allowed
        (0.95, 0.05, 0.0, 8),
        (1.0, 0.1, 0.0, 8),
        (0.9, 0.4, 0.0, 4),  # this pair in bf16 (docs/architecture.md §7)
        (0.8, 0.15, 0.0, 5),
        (0.6, 0.1, 0.0, 3),
        (0.5, 0.4, 0.0, 1),
        (0.3, 0.5, 0.0, 0),  # speculation does not pay: off
        (0.0, 0.1, 0.0, 0),
        (0.7, 0.2, 1.0, 5),  # a round trip as long as a target step: longer drafts amortise it
        (0.8, 0.15, 0.5, 7),
        (0.8, 0.15, 2.0, 8),
        (0.9, 0.4, 1.0, 8),
    ],
)
def test_chooser_picks_the_analytic_optimum(alpha, c, rtt, k):
    assert best_draft_length(alpha, c, lambda _: 1.0, rtt, rtt, max_k=8) == k
    chooser = AdaptiveK(measured_costs(c, {0: 1.0, 8: 1.0}, rtt, alpha), max_k=8)
    assert chooser.next_k(tokens_left=100) == (k or 0)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 8) == 1


def test_max_k_and_the_tokens_left_bound_the_choice():
    chooser = AdaptiveK(measured_costs(0.05, {0: 1.0, 8: 1.0}, alpha=0.95), max_k=3)
    assert chooser.next_k(tokens_left=100) == 3
    assert chooser.next_k(tokens_left=3) == 2  # the target adds one token of its own
    assert chooser.next_k(tokens_left=1) == 0


def test_verify_seconds_interpolates_and_extends_the_measured_curve():
    costs = measured_costs(0.1, {0: 1.0, 4: 3.0})
    assert costs.verify_seconds(2) == pytest.approx(2.0)
    assert costs.verify_seconds(6) == pytest.approx(4.0)  # along the last slope
    assert measured_costs(0.1, {0: 1.0}).verify_seconds(5) == 1.0  # one point: the premise (flat)


def test_a_costly_verify_makes_a_shorter_k_best():
    """The CPU case: scoring K + 1 tokens costs far more than one step, so only short drafts pay."""
    flat = AdaptiveK(measured_costs(0.1, {0: 1.0, 8: 1.0}, alpha=0.85), max_k=8)
    steep = AdaptiveK(measured_costs(0.1, {0: 1.0, 1: 1.3, 4: 3.2, 8: 5.0}, alpha=0.85), max_k=8)
    assert flat.next_k(100) == 7  # 4.85 tokens / 1.7 steps, just ahead of K = 8 (5.12 / 1.8)
    assert steep.next_k(100) == 1


def test_a_fresh_worker_measures_a_decode_then_a_draft_before_choosing():
    costs = ServiceCosts()
    chooser = AdaptiveK(costs, max_k=8)
    assert chooser.next_k(100) == 0  # nothing known: measure t_verify(0) first
    costs.record_verify(0, 1.0, 0.0)
    assert chooser.next_k(100) == 4  # then one speculative step at the first K
    costs.record_verify(4, 1.0, 0.0)
    costs.record_draft(4, 0.4, 0.0)
    assert costs.ready()
    # Under load one request at a time explores (each explorer's catch-up stalls the other streams),
    # and when it ends before the worker is ready, the next one to ask takes over.
    busy = ServiceCosts()
    busy.record_verify(0, 1.0, 0.0)
    busy.target_streams = 8
    first, second = AdaptiveK(busy, max_k=8), AdaptiveK(busy, max_k=8)
    assert [first.next_k(100), second.next_k(100), first.next_k(100), second.next_k(100)] == [4, 0, 4, 0]
    del first
    gc.collect()
    assert second.next_k(100) == 4


def off_and_probe_steps(chooser: AdaptiveK, steps: int) -> list[int]:
    return [chooser.next_k(100) for _ in range(steps)]


def test_collapsed_acceptance_switches_off_probes_with_backoff_and_recovers():
    costs = measured_costs(0.15, {0: 1.0, 8: 1.0}, alpha=0.8)
    chooser = AdaptiveK(costs, max_k=8)
    assert chooser.next_k(100) > 0
    for _ in range(12):  # a stretch where every first guess is rejected
        chooser.observe(4, 0)
    ks = off_and_probe_steps(chooser, 40)
    probes = [i for i, k in enumerate(ks) if k]
    # off, except a probe after 4 steps, then 8, then 16 while probes keep failing
    assert probes == [PROBE_MIN_STEPS - 1, 3 * PROBE_MIN_STEPS - 1, 7 * PROBE_MIN_STEPS - 1]
    assert all(k >= 1 for k in (ks[i] for i in probes))
    for _ in range(6):  # the text turns easy again: the probes are accepted
        chooser.observe(4, 4)
    assert off_and_probe_steps(chooser, 5) == [8] * 5  # back on, every step
    assert chooser.probe_every == PROBE_MIN_STEPS  # and a later collapse starts with short probes again


def test_a_saturated_target_switches_off_and_a_quiet_one_back_on():
    """Under load, verifying K tokens stops riding free: t_verify(K) grows, K = 0 wins, until it falls."""
    costs = measured_costs(0.1, {0: 1.0, 4: 1.1}, alpha=0.7)
    chooser = AdaptiveK(costs, max_k=4)
    assert chooser.next_k(100) == 4
    for _ in range(10):
        costs.record_verify(4, 6.0, 0.0)  # busy target: batched with everyone else's rows
    assert off_and_probe_steps(chooser, PROBE_MIN_STEPS - 1) == [0] * (PROBE_MIN_STEPS - 1)
    assert chooser.next_k(100) == 1  # the probe: the best K if drafting at all (t_verify(1) is interpolated)
    for _ in range(10):
        costs.record_verify(4, 1.1, 0.0)  # the load is gone
    assert chooser.next_k(100) >= 3


def test_a_pass_time_fit_recovers_the_line_and_keeps_its_slope_through_passes_of_one_size():
    fit = PassTime()
    for tokens in [1, 5, 8, 40, 3, 16] * 3:
        fit.add(tokens, 0.19 + 0.02 * tokens)
    assert fit.sloped and fit.a == pytest.approx(0.19) and fit.b == pytest.approx(0.02)
    for _ in range(40):  # only decodes of 8 rows: nothing new about the slope, and it is kept
        fit.add(8, 0.19 + 0.02 * 8 + 0.05)  # the machine got slower: the intercept follows
    assert fit.b == pytest.approx(0.02, rel=0.15) and fit.seconds(8) == pytest.approx(0.40, rel=0.02)


def cpu_like_load(costs: ServiceCosts, calls: int) -> None:
    """Passes of a CPU-like target at `calls` calls per pass (0.19 s + 0.02 s per new token:
    reading the weights, then compute per token), decodes and K = 4 verifies alike; a draft
    forward of those rows costs 0.025 s + 0.005 s per row."""
    for tokens_per_call in (1, 5) * 5:
        tokens = calls * tokens_per_call
        costs.record_target_pass(PassCost(calls, tokens, 0.19 + 0.02 * tokens), longest=9)
    for _ in range(10):
        costs.record_draft(4, 9.9, 0.0, PassCost(calls, 5 * calls, 4 * (0.025 + 0.005 * calls)))


def test_the_chooser_prices_k_at_the_load_shrinks_it_turns_it_off_and_back_on():
    """The batch-aware chooser on synthetic costs: with B calls per target pass, drafting K puts
    B·(K + 1) tokens in it. K falls as B grows, speculation is off at 16, and back when B falls."""
    costs = measured_costs(0.03, {0: 0.2, 4: 0.24}, alpha=0.8)
    chooser = AdaptiveK(costs, max_k=8)
    chooser.alpha = Ewma(0.0, 0.8)  # the request's α, held still
    chosen = {}
    for calls in (1, 2, 4, 8, 16):
        cpu_like_load(costs, calls)
        chosen[calls] = chooser._best(8)
    assert chosen[1] >= 3 and chosen[16] == 0
    assert all(chosen[a] >= chosen[b] for a, b in zip((1, 2, 4, 8), (2, 4, 8, 16))), chosen
    assert 0 < chosen[8] < chosen[1]
    # Off for the load alone: no probes (they would cost every stream a draft catch-up), since
    # the passes' fit sees the load fall on its own; and back on when it does.
    assert [chooser.next_k(100) for _ in range(3 * PROBE_MAX_STEPS)] == [0] * (3 * PROBE_MAX_STEPS)
    cpu_like_load(costs, 1)
    assert chooser._best(8) == chosen[1] and chooser.next_k(100) == chosen[1]


def test_a_prefill_pass_does_not_set_the_verify_slope():
    """llama.cpp on an AVX-512 CPU (measured): a decode 56 ms, a verify of 5 positions 220 ms, a
    200-token prompt 0.5 s (its batched kernels make a prompt token far cheaper than a scored
    position). Fitted with the prefill, the slope would say a verify costs little more than a
    decode and the draft pays at α = 1; without it, the chooser rightly stays target-only."""
    costs = ServiceCosts()
    costs.record_target_pass(PassCost(calls=1, tokens=201, seconds=0.5), longest=9)  # the first step
    for _ in range(3):
        costs.record_target_pass(PassCost(calls=1, tokens=1, seconds=0.056), longest=9)
        costs.record_target_pass(PassCost(calls=1, tokens=5, seconds=0.22), longest=9)
    assert costs.target_pass.b == pytest.approx(0.041, rel=0.01)
    assert costs.verify_seconds(4) == pytest.approx(0.22, rel=0.01)
    costs.record_verify(0, 0.056, 0.0)
    costs.record_draft(4, 4 * 0.032, 0.0)
    chooser = AdaptiveK(costs, max_k=8)
    chooser.alpha = Ewma(0.0, 1.0)
    assert chooser._best(8) == 0


def test_the_load_is_the_streams_the_target_holds_not_the_calls_a_drifting_pass_carried():
    costs = ServiceCosts()
    for _ in range(20):
        costs.record_target_pass(PassCost(calls=3, tokens=15, seconds=0.3, sessions=8), longest=9)
    assert costs.load() == pytest.approx(8.0)


def test_a_request_starts_from_the_workers_recent_acceptance():
    costs = measured_costs(0.15, {0: 1.0, 8: 1.0}, alpha=0.8)
    first = AdaptiveK(costs, max_k=8)
    for _ in range(100):
        first.observe(4, 0)
    assert costs.alpha.value < 0.1  # the worker's average followed
    second = AdaptiveK(costs, max_k=8)
    assert second.alpha.value == costs.alpha.value
    assert second.next_k(100) == 0


def test_turning_on_pays_the_drafts_catch_up_spread_over_the_tokens_left():
    """The first speculative step (or one after target-only steps) first feeds the draft every token
    it has not seen: worth it for a long completion, not for the last few tokens of a long prompt."""
    costs = measured_costs(0.1, {0: 1.0, 8: 1.0}, alpha=0.8)
    assert costs.catchup_seconds(10) == pytest.approx(10 * 0.1)  # until measured: a guess's time per token
    costs.record_catchup(behind=100, seconds=4 * 0.1 + 2.0, k=4)
    assert costs.catchup_seconds(100) == pytest.approx(2.0)
    assert AdaptiveK(costs, max_k=8).next_k(tokens_left=500, behind=100) > 0
    assert AdaptiveK(costs, max_k=8).next_k(tokens_left=8, behind=1000) == 0
    chooser = AdaptiveK(costs, max_k=8)
    assert chooser.next_k(tokens_left=500, behind=100) > 0
    assert chooser.next_k(tokens_left=8, behind=1000) > 0  # on already: the draft is in step, nothing to pay
    # With 8 streams at the target, a catch-up holds up all their passes on shared cores: priced 8 times.
    assert AdaptiveK(costs, max_k=8).next_k(tokens_left=100, behind=500) > 0
    costs.target_streams = 8
    assert AdaptiveK(costs, max_k=8).next_k(tokens_left=100, behind=500) == 0


def test_from_off_speculation_must_beat_target_only_by_a_margin():
    """Hysteresis: a stream the chooser turned off comes back on only for a clear gain, so streams
    at the edge do not flip on and off (each switch costs the draft a catch-up beside the target)."""
    costs = measured_costs(0.1, {0: 1.0, 4: 1.0}, alpha=0.7)
    chooser = AdaptiveK(costs, max_k=1)
    rate = lambda k: tokens_per_second(0.7, k, 0.1, costs.verify_seconds(k), 0.0)  # noqa: E731
    assert chooser.next_k(100) == 1 and rate(1) / rate(0) > ON_MARGIN  # 1.7 tokens / 1.1 s against 1 / 1 s
    for _ in range(20):
        costs.record_verify(1, 2.0, 0.0)  # the verify got dearer: K = 1 now loses
    assert chooser.next_k(100) == 0
    for _ in range(20):
        costs.record_verify(1, 1.52, 0.0)  # a 1.05x gain again: not enough to switch back on
    assert 1.0 < rate(1) / rate(0) < ON_MARGIN
    assert chooser.next_k(100) == 0 and chooser._best(1) == 1
    for _ in range(20):
        costs.record_verify(1, 1.0, 0.0)
    assert chooser.next_k(100) == 1


def test_under_load_the_requests_of_a_worker_decide_alike():
    """With streams sharing the target's passes, a request that drafts while the others decode breaks
    the batch: every request then prices K at the worker's α, not its own."""
    costs = measured_costs(0.03, {0: 0.2, 4: 0.24}, alpha=0.75)
    easy, hard = AdaptiveK(costs, max_k=8), AdaptiveK(costs, max_k=8)
    easy.alpha, hard.alpha = Ewma(0.0, 0.98), Ewma(0.0, 0.3)
    assert easy._best(8) != hard._best(8)  # alone (B = 1) each follows its own text
    cpu_like_load(costs, 4)
    assert costs.load() >= SHARED_LOAD and easy._best(8) == hard._best(8)


def test_a_draft_slowed_by_the_load_does_not_make_the_off_switch_probe():
    """On shared cores a draft guesses slower while the target is busy. That is the load's doing: off
    for the load is judged with the draft at its floor (the cheapest guess lately), so no probes
    (each would cost a catch-up beside the busy target), and speculation returns when the load goes."""
    costs = measured_costs(0.03, {0: 0.2, 4: 0.24}, alpha=0.8)
    chooser = AdaptiveK(costs, max_k=8)
    cpu_like_load(costs, 1)
    assert chooser.next_k(100) > 0 and costs.draft_floor == pytest.approx(0.03)
    cpu_like_load(costs, 16)
    for _ in range(5):  # one stream's guesses, ten times slower beside the busy target
        costs.record_draft(1, 0.3, 0.0, PassCost(1, 1, 0.3))
    assert costs.draft_seconds(1.0) > 0.1 and costs.draft_floor < 0.05
    assert [chooser.next_k(100) for _ in range(3 * PROBE_MAX_STEPS)] == [0] * (3 * PROBE_MAX_STEPS)
    cpu_like_load(costs, 1)
    for _ in range(5):
        costs.record_draft(4, 4 * 0.03, 0.0, PassCost(1, 5, 4 * 0.03))
    assert chooser.next_k(100) > 0


def test_a_draft_pass_that_carried_a_catch_up_is_not_a_guess_time():
    """A Propose batched with another stream's catch-up pays for it: the padded pass computes every
    row as long as the catch-up. Its time per guess would price the draft far too high."""
    costs = measured_costs(0.03, {0: 0.2, 4: 0.24}, alpha=0.8)
    before = costs.draft_per_token.value
    costs.record_draft(4, 4 * 0.3, 0.0, PassCost(4, 4 * 26, 4 * 0.3))  # one row caught up on 22 tokens
    assert costs.draft_per_token.value == before
    costs.record_draft(4, 4 * 0.04, 0.0, PassCost(4, 4 * 6, 4 * 0.04))  # guesses only (cursors of 2)
    assert costs.draft_per_token.value > before


def test_a_probe_that_would_catch_up_on_a_long_context_is_skipped():
    """At 8 streams after 1,000-token prompts, each probe made the draft catch up on the whole
    context beside the busy target: 1 % of the steps speculated and every stream lost 22 %."""
    costs = measured_costs(0.15, {0: 1.0, 8: 1.0}, alpha=0.8)
    costs.record_catchup(behind=100, seconds=100 * 0.01 + 4 * 0.15, k=4)  # 10 ms a token
    chooser = AdaptiveK(costs, max_k=8)
    chooser.next_k(100)
    for _ in range(12):  # acceptance collapses: off, with probes
        chooser.observe(4, 0)
    assert any(chooser.next_k(100, behind=20) for _ in range(PROBE_MIN_STEPS))  # a short catch-up: probed
    assert not any(chooser.next_k(100, behind=1000) for _ in range(4 * PROBE_MAX_STEPS))  # a prefill's: never


def test_a_stream_alone_that_the_margin_keeps_off_still_probes():
    """Off for the load alone skips probes only under a load: alone (B = 1) there is no load to fall,
    and a stream that ON_MARGIN keeps off at a small gain must still probe, or it stays off for good
    on a measurement it never renews (CI: a quiet request drafted nothing in 16 tokens)."""
    costs = measured_costs(0.03, {0: 0.21, 1: 0.23}, alpha=0.3)
    cpu_like_load(costs, 1)  # a pass fit (sloped) at one stream: decode 0.21 s, K = 1 0.23 s, a guess 0.03 s
    chooser = AdaptiveK(costs, max_k=8)
    chooser.alpha = Ewma(0.0, 0.1)
    assert chooser.next_k(100) == 0 and chooser.on is False  # acceptance too low: off
    chooser.alpha = Ewma(0.0, 0.3)  # now K = 1 gains 1.05x: under the margin, so it stays off...
    assert chooser._best(8) == 1 and chooser.next_k(100) == 0
    assert any(chooser.next_k(100) for _ in range(PROBE_MIN_STEPS))  # ...but probes, as off always does


def test_probes_are_paid_from_the_workers_budget_across_its_requests():
    """Each off step adds PROBE_BUDGET of a decode; a probe spends its catch-up, guesses and longer
    verify. Requests that start while the budget is spent do not probe at all."""
    costs = measured_costs(0.15, {0: 1.0, 1: 2.0, 8: 6.0}, alpha=0.3, probe_budget=0.0)  # off: verify costly, α low
    probe_cost = costs.catchup_seconds(20) + 1 * 0.15 + (costs.verify_seconds(1) - 1.0)
    steps = []
    for _ in range(40):  # 40 short requests, each 20 tokens behind the draft
        chooser = AdaptiveK(costs, max_k=8)
        steps += [chooser.next_k(100, behind=20) for _ in range(16)]
    probes = sum(k > 0 for k in steps)
    assert 1 <= probes <= 640 * PROBE_BUDGET / probe_cost + 1  # what the off steps paid for, no more
    assert probes < 40  # per-request probing would have probed in every request, at its step 4
    assert 0 <= costs.probe_budget < probe_cost + PROBE_BUDGET * 16


def test_under_load_a_probe_costs_every_stream_of_the_pass():
    """At B streams the draft's catch-up and guesses run beside the pass all B wait for: a budget that
    holds a model probe at B = 1 does not at B = 8; a lookup probe costs only the longer verify."""
    costs = measured_costs(0.15, {0: 1.0, 1: 2.0, 8: 6.0}, alpha=0.3)
    quiet = costs.catchup_seconds(20) + 0.15 + (costs.verify_seconds(1) - 1.0)
    costs.probe_budget = 1.5 * quiet
    costs.target_streams = 8
    assert not costs.spend_on_probe(20, 1) and costs.probe_budget == 1.5 * quiet
    assert costs.spend_on_probe(20, 1, draft=False)  # the lookup's: no catch-up, no guesses
    costs.target_streams, costs.probe_budget = 1, 1.5 * quiet
    assert costs.spend_on_probe(20, 1) and costs.probe_budget == pytest.approx(0.5 * quiet)
