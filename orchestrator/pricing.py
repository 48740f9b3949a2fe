"""Pricing a step of K guesses: what it is expected to emit and to cost, the K that maximises the
rate, and what drafting the next step ahead saves. Arithmetic only: the measured inputs are
costs.py's, the choices adaptive.py's.

If the target accepts each guess with probability α (independently), a step that drafts K
tokens emits on average
    E[tokens](K) = 1 + α + … + α^K = (1 − α^(K+1)) / (1 − α)
and costs
    seconds(K) = K·t_draft + t_verify(K) + RTT(K)        (K = 0: one target-only decode)
where t_draft is the draft's time per token, t_verify(K) the target's time to score K + 1
tokens (t_verify(0) is a plain decode), and RTT(K) the network: two round trips for a
speculative step, one for a decode. The chooser takes K maximising E[tokens](K) / seconds(K)
over 0..max_k (`best_draft_length`).

Drafting ahead (ahead.py) is priced the same way, per step, by `draft_ahead_gain`: the Propose a step
need not wait for, with probability α^K·β (all K accepted, and the draft's guess for the bonus
position right), against the wait for a pre-draft that comes after the verdict and, where the two
services share cores, the draft's work beside the verify. How much they share is measured, not
assumed: a guess drafted beside a verify against the cheapest guess lately (`ahead_slowdown`).
"""


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens](K) = 1 + α + … + α^K: accepted guesses plus the target's own token."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def tokens_per_second(alpha: float, k: int, t_draft: float, t_verify: float, rtt: float) -> float:
    """Expected rate of a step with K guesses; rtt is the step's whole network time."""
    return expected_tokens(alpha, k) / (k * t_draft + t_verify + rtt)


def draft_ahead_gain(
    alpha: float,
    bonus_match: float,
    k: int,
    k_next: int,
    t_draft: float,
    t_verify: float,
    rtt_draft: float,
    rtt_target: float,
    shared: float = 0.0,
) -> float:
    """Expected seconds a step of K guesses saves by drafting step n+1's K' guesses ahead (ahead.py);
    negative where it costs. The ahead call (K' + 1 draft tokens: its guess b for the bonus position
    first) starts as the Verify is sent. With probability α^K all K are accepted and the step waits
    for b if it is not back by the verdict (`late`); with probability α^K·β (β: b is the target's
    own token) the next step needs no Propose and saves its K'·t_draft + RTT. `shared` in [0, 1]: how
    much the draft's work beside the verify slows both (0: remote or separate cores; 1: the same
    cores), paid every time, used or not: the (K' + 1)·t_draft it takes from the target's pass."""
    contention = shared * (k_next + 1) * t_draft
    verdict = t_verify + rtt_target + contention
    ahead = (k_next + 1) * t_draft * (1 + shared) + rtt_draft
    late = max(0.0, ahead - verdict)
    all_accepted = alpha**k
    return all_accepted * bonus_match * (k_next * t_draft + rtt_draft) - all_accepted * late - contention


def best_draft_length(
    alpha: float,
    t_draft: float,
    t_verify,
    rtt_draft: float,
    rtt_target: float,
    max_k: int,
    min_k: int = 0,
    switch_on: float = 0.0,
    tokens_left: int = 1,
    margin: float = 1.0,
    decode_run: int = 1,
) -> int:
    """argmax over K in min_k..max_k of E[tokens](K) / seconds(K); t_verify is a function of K.
    switch_on: the seconds turning speculation on costs once (the draft's catch-up), spread over
    the steps left; margin: how much more than target-only a K > 0 must promise; decode_run: the
    tokens of a target-only step, which pays its round trip once."""

    def rate(k: int) -> float:
        if not k:
            return tokens_per_second(alpha, 0, t_draft, t_verify(0), rtt_target / decode_run)
        once = switch_on * expected_tokens(alpha, k) / max(1, tokens_left)
        return tokens_per_second(alpha, k, t_draft, t_verify(k), rtt_target + rtt_draft + once) / margin

    return max(range(min_k, max_k + 1), key=rate)
