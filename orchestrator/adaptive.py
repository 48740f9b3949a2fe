"""Choosing the draft length K from the numbers, every step, with a recoverable off-switch.

The chooser (AdaptiveK, one per request) takes the K that maximises E[tokens](K) / seconds(K)
(pricing.py) from running estimates: α per request (starting from the worker's recent average), the
costs per worker (costs.py: shared by its requests, so they follow the load, and priced at it).

Turning speculation on has a price of its own: the draft first catches up on every token it has
not seen (the prompt on a request's first speculative step; the tokens of the target-only steps
since it was last asked). That catch-up is paid once and spread over the steps left:
    seconds(K) += B · catch-up(tokens behind) · E[tokens](K) / tokens left        (K > 0, when off)
and, from off, K > 0 must beat target-only by ON_MARGIN. Under load the catch-up is priced B times:
where the two services share the cores (`specd up` on a CPU), a draft catching up takes cores from
the target's passes, which all B streams wait for (measured: a few whole-context catch-ups at 8
streams cost every stream 10 %).

The load model (costs.py) assumes every stream drafts the same K, so that the passes stay full. Streams that
disagree break them: a stream at the draft misses the pass the others decode in, and its verify
takes a pass of its own (each pass reads the weights again). So under load (B ≥ SHARED_LOAD)
every request prices K at the worker's α, not its own, and the streams of a worker decide alike.

Off, the target decodes on alone: a target-only step asks for a run of tokens (target.proto
DecodeRequest.steps), as many as take DECODE_RUN_SECONDS at the load, so the round trip and the
orchestrator's work per call (which on shared cores also slows the target's pass) are paid once a
run, not once a token (as vLLM's multi-step scheduling pays its CPU work once per several steps).
So K = 0 is priced at t_verify(0) + RTT/run per token, and the probe schedule and budget count the
tokens of a run as the off steps they replace. Where the lookup has guesses the step stays one token
(generation.py), so the lookup's own comparison prices off as one decode and one round trip.

K = 0 is the off-switch: speculation stopped paying (acceptance collapsed, or the target is
so busy that verifying K tokens no longer rides free). While off, a probe step drafts again
after a few steps (doubling up to PROBE_MAX_STEPS while probes keep failing) and refreshes α
and the costs, so one bad stretch never switches speculation off for good. A probe that would
first catch the draft up on more than PROBE_MAX_BEHIND tokens (after a long prompt) is skipped:
counted in tokens, since a catch-up's measured seconds are noise on small models; speculation
then returns only when the chooser itself says the catch-up pays.

Probes are paid from a budget the worker keeps over all its requests: each target-only step adds
PROBE_BUDGET of its time, and a probe spends what it is expected to cost beyond a decode (the
draft's catch-up, its guess, the longer verify), to every stream of the pass: under load the longer
verify delays all B of them and the draft works beside their pass, so a probe costs B times as much
(measured on the llama.cpp engine, 2 cores, 8 streams: priced as one stream's, probes left
speculation at 0.78× off; priced at the load, 1.06×). A prompt lookup passed over for target-only is
probed from the same budget under load (one guess: the longer verify). Where speculation does not
pay for good (a CPU whose verify costs several decode steps), a stream of short requests then probes
a few percent of the time, not a few times each: measured on an AVX2 CPU (2 cores, llama.cpp
engines), per-request probes alone (3 per 64-token request, each first catching the draft up on its
prompt) made speculation 19 % slower than off (scripts/bench_llama_cpp.py).
"""

from __future__ import annotations

import weakref

from specd.orchestrator.costs import Ewma, PassCost, PassTime, ServiceCosts
from specd.orchestrator.pricing import best_draft_length, draft_ahead_gain, expected_tokens, tokens_per_second

# The chooser's names, and those of its model and measurements (pricing.py, costs.py), as callers import them.
__all__ = [
    "AdaptiveK",
    "decode_run",
    "DEFAULT_MAX_DRAFT_TOKENS",
    "ON_MARGIN",
    "PROBE_BUDGET",
    "PROBE_MAX_STEPS",
    "PROBE_MIN_STEPS",
    "SHARED_LOAD",
    "Ewma",
    "PassCost",
    "PassTime",
    "ServiceCosts",
    "best_draft_length",
    "draft_ahead_gain",
    "expected_tokens",
    "tokens_per_second",
]

REQUEST_ALPHA_WEIGHT = 0.2  # per accept/reject observation: a request's α follows its text fast
FIRST_K = 4  # the first speculative step on a fresh worker, before t_verify(K) is known
PROBE_MIN_STEPS = 4
PROBE_MAX_STEPS = 32
DEFAULT_MAX_DRAFT_TOKENS = 8  # the bound of an adaptive K (--max-draft-tokens)
ON_MARGIN = 1.1  # from off, speculation must promise this much more than target-only to turn on
SHARED_LOAD = 1.5  # from this load on, every request of a worker prices K at the worker's α
PROBE_MAX_BEHIND = 64  # a probe that would first catch the draft up on more tokens is skipped
PROBE_BUDGET = 0.03  # the share of its target-only time a worker may spend on probes
DECODE_RUN_SECONDS = 0.2  # a target-only step asks for the tokens the target decodes in about this long
MAX_DECODE_RUN = 16  # ... and at most this many (a stream's text still arrives in pieces of a few)


def decode_run(costs: ServiceCosts) -> int:
    """Tokens a target-only step asks the target for (a Decode run): as many as it decodes in about
    DECODE_RUN_SECONDS at the load, at most MAX_DECODE_RUN; one until a decode is measured."""
    t_decode = costs.verify_seconds(0)
    return max(1, min(MAX_DECODE_RUN, int(DECODE_RUN_SECONDS / t_decode))) if t_decode else 1


class AdaptiveK:
    """One request's draft length, re-chosen every step."""

    def __init__(self, costs: ServiceCosts, max_k: int):
        self.costs = costs
        self.max_k = max_k
        self.alpha = Ewma(REQUEST_ALPHA_WEIGHT, costs.alpha.value)
        self.lookup_alpha = Ewma(REQUEST_ALPHA_WEIGHT, costs.lookup_alpha.value)  # the prompt lookup's own
        self.lookup_off = 0  # steps the lookup had guesses and was passed over for target-only
        self.lookup_every = PROBE_MIN_STEPS  # its probe schedule: doubling while probes fail
        self.off_steps = 0
        self.probe_every = PROBE_MIN_STEPS
        self.on: bool | None = None  # did the last choice draft (None: none yet)? On: K > 0 has no switch-on price

    def next_k(self, tokens_left: int, behind: int = 0) -> int:
        """K for the next step (0: target-only). behind: tokens the draft would first catch up on
        (beyond the last committed one, which every call sends); counted when turning on from off."""
        max_k = min(self.max_k, tokens_left - 1)  # the target adds one token of its own
        if max_k < 1:
            return 0
        if not self.costs.ready():  # a fresh worker measures; under load one request at a time does
            return self._explore(max_k) if self._may_explore() else 0
        k = self._best(max_k) if self.on else self._best(max_k, behind, tokens_left, margin=self.on is False)
        self.on = k > 0
        if k:
            self.off_steps, self.probe_every = 0, PROBE_MIN_STEPS
            return k
        if (
            self.costs.load() >= SHARED_LOAD
            and self.costs.target_pass.sloped
            and self._best(max_k, calls=1.0, quiet=True)
        ):
            return 0  # off for the load alone: the passes' fit turns it back on as B falls, no probe needed
        self._count_off(1)
        if self.off_steps < self.probe_every:
            return 0
        if behind > PROBE_MAX_BEHIND:  # the probe's catch-up would be a prefill beside the busy target
            return 0
        k = self._best(max_k, behind, tokens_left, min_k=1)  # the probe: the best K if speculating at all
        if not self.costs.spend_on_probe(behind, k):
            return 0  # not yet paid for: the next step asks again
        self.off_steps, self.probe_every = 0, min(2 * self.probe_every, PROBE_MAX_STEPS)
        return k

    def model_alpha(self) -> float:
        """The draft model's α for this request: its own, or under load the worker's (so that the
        streams of a worker decide alike, see the module's docstring)."""
        return self.alpha.value if self.costs.load() < SHARED_LOAD else self.costs.alpha.value

    def lookup_k(self, tokens_left: int, found: int, behind: int = 0, model: bool = True) -> int:
        """K for the prompt lookup's `found` guesses, or 0 where the model's guess (or none) promises
        more: lookup guesses cost no draft time and no draft round trip, only the longer verify, so
        they are priced at their own α with t_draft = 0 against target-only and (`model`: the
        request may use the draft model) the model's best K. Where target-only wins, one guess now
        and then (doubling the wait while they fail) measures the lookup's α again."""
        costs = self.costs
        max_k = min(self.max_k, tokens_left - 1, found)
        if max_k < 1 or 0 not in costs.verify_by_k:
            return 0
        rtt = costs.rtt_target.value or 0.0

        def rate(alpha: float, k: int, t_draft: float = 0.0, rtt_draft: float = 0.0) -> float:
            return tokens_per_second(alpha, k, t_draft, costs.verify_seconds(k) or 0.0, rtt + (rtt_draft if k else 0))

        k = max(range(1, max_k + 1), key=lambda k: rate(self.lookup_alpha.value, k))
        off = rate(1.0, 0)  # target-only
        model_rate = 0.0
        if model and costs.ready():
            model_k = self._best(min(self.max_k, tokens_left - 1), behind, tokens_left, margin=not self.on)
            model_rate = rate(self.model_alpha(), model_k, costs.draft_seconds() or 0.0, costs.rtt_draft.value or 0.0)
        if rate(self.lookup_alpha.value, k) > max(off, model_rate):
            self.lookup_off, self.lookup_every = 0, PROBE_MIN_STEPS
            return k
        if model_rate > off:
            return 0  # the draft model's turn
        # Target-only beats both: a probe now and then (the model's schedule) keeps the lookup's α
        # current, or one low estimate would never be revised. It costs one more scored position.
        self.lookup_off += 1
        if self.lookup_off < self.lookup_every:
            return 0
        if costs.load() >= SHARED_LOAD and not costs.spend_on_probe(0, 1, draft=False):
            return 0  # under load its longer verify delays every stream: paid from the budget
        self.lookup_off, self.lookup_every = 0, min(2 * self.lookup_every, PROBE_MAX_STEPS)
        return 1

    def decoded_run(self, tokens: int) -> None:
        """A target-only step decoded `tokens` in a run: the probe schedule and budget count each
        token past the first as the off step it stands for."""
        self._count_off(max(0, tokens - 1))

    def _count_off(self, steps: int) -> None:
        """Target-only steps toward the next probe, each paying PROBE_BUDGET of a decode into the budget."""
        self.off_steps += steps
        self.costs.probe_budget += PROBE_BUDGET * (self.costs.verify_seconds(0) or 0.0) * steps

    def observe(self, k: int, accepted: int, lookup: bool = False) -> None:
        """One speculative step: `accepted` of `k` guesses (the prompt lookup's, or the model's).
        Guesses after the first rejection say nothing."""
        request, worker = (self.lookup_alpha, self.costs.lookup_alpha) if lookup else (self.alpha, self.costs.alpha)
        if lookup and accepted == k:
            self.lookup_every = PROBE_MIN_STEPS  # the text repeats here: look again soon
        for outcome in [1.0] * accepted + [0.0] * (accepted < k):
            request.add(outcome)
            worker.add(outcome)

    def _may_explore(self) -> bool:
        """Quiet, or under load this request is the worker's one explorer (the first to ask while no
        other live request is): each exploring stream makes the draft catch up beside the busy target,
        but a worker that never explored would stay off for as long as the load lasts."""
        costs = self.costs
        if costs.load() < SHARED_LOAD:
            return True
        explorer = costs.explorer() if costs.explorer else None
        if explorer is None:
            costs.explorer = weakref.ref(self)  # dies with its request: then another may explore
        return explorer in (None, self)

    def _explore(self, max_k: int) -> int:
        """A fresh worker measures a decode, then a speculative step, before it compares them."""
        if 0 not in self.costs.verify_by_k:
            return 0
        return min(FIRST_K, max_k)

    def _best(
        self,
        max_k: int,
        behind: int = 0,
        tokens_left: int = 1,
        margin: bool = False,
        min_k: int = 0,
        calls: float | None = None,
        quiet: bool = False,
    ) -> int:
        """The best K at `calls` calls per pass (default: the load now); turning on costs the catch-up
        on `behind` tokens, spread over tokens_left, and with `margin` must beat off by ON_MARGIN.
        quiet: price the draft at its floor (a guess when it had the cores to itself: under load on
        shared cores it is slower, and that is the load's doing, not the draft's)."""
        costs = self.costs
        return best_draft_length(
            self.model_alpha(),
            (quiet and costs.draft_floor) or costs.draft_seconds(calls),
            lambda k: costs.verify_seconds(k, calls),
            costs.rtt_draft.value or 0.0,
            costs.rtt_target.value or 0.0,
            max_k,
            min_k,
            switch_on=costs.catchup_seconds(behind) * costs.load(),
            tokens_left=tokens_left,
            margin=ON_MARGIN if margin else 1.0,
            decode_run=decode_run(costs),
        )
