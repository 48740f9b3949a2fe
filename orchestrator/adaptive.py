"""Choosing the draft length K from the numbers, every step, with a recoverable off-switch.

If the target accepts each guess with probability α (independently), a step that drafts K
tokens emits on average
    E[tokens](K) = 1 + α + … + α^K = (1 − α^(K+1)) / (1 − α)
and costs
    seconds(K) = K·t_draft + t_verify(K) + RTT(K)        (K = 0: one target-only decode)
where t_draft is the draft's time per token, t_verify(K) the target's time to score K + 1
tokens (t_verify(0) is a plain decode), and RTT(K) the network: two round trips for a
speculative step, one for a decode. The chooser takes K maximising E[tokens](K) / seconds(K)
over 0..max_k, from running estimates: α per request (starting from the worker's recent
average), the costs per worker (shared by its requests, so they follow the load).

Under load t_verify(K) is priced at the load: the services say, with every batched call, how many
calls the pass that served it carried and how many positions it computed (in transformers each call
padded to the longest: one verify among decodes makes them all K + 1 long; in llama.cpp the calls'
own, whose cost is per position: counted padded, a verify among 7 decodes would say 40 positions for
12 computed, and the slope would price verifying at a third), what it cost and how many sessions the
service holds, and the worker fits a pass's seconds as a + b·tokens over recent passes. With B
streams (the sessions held, at least the calls per pass), every stream drafting K puts B·(K + 1)
tokens in a pass: t_verify(K) = a + b·B·(K + 1). Where a pass
is dominated by reading the weights (b·tokens ≪ a: a GPU, or a CPU at small B), verifying K
rides almost free and K stays high; where it is dominated by compute (b·B large: a CPU under
load), K shrinks and turns off, and turns back on when B falls.

Turning speculation on has a price of its own: the draft first catches up on every token it has
not seen (the prompt on a request's first speculative step; the tokens of the target-only steps
since it was last asked). That catch-up is paid once and spread over the steps left:
    seconds(K) += B · catch-up(tokens behind) · E[tokens](K) / tokens left        (K > 0, when off)
and, from off, K > 0 must beat target-only by ON_MARGIN. Under load the catch-up is priced B times:
where the two services share the cores (`specd up` on a CPU), a draft catching up takes cores from
the target's passes, which all B streams wait for (measured: a few whole-context catch-ups at 8
streams cost every stream 10 %).

The load model assumes every stream drafts the same K, so that the passes stay full. Streams that
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

Drafting ahead (ahead.py) is priced the same way, per step, by `draft_ahead_gain`: the Propose a step
need not wait for, with probability α^K·β (all K accepted, and the draft's guess for the bonus
position right), against the wait for a pre-draft that comes after the verdict and, where the two
services share cores, the draft's work beside the verify. How much they share is measured, not
assumed: a guess drafted beside a verify against the cheapest guess lately (`ahead_slowdown`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

ALPHA_PRIOR = 0.7  # before anything is measured: a typical code/chat pair
REQUEST_ALPHA_WEIGHT = 0.2  # per accept/reject observation: a request's α follows its text fast
WORKER_ALPHA_WEIGHT = 0.05  # the worker's average moves slowly: it seeds new requests
TIME_WEIGHT = 0.3  # per measured call: costs follow the load within a few steps
FIRST_K = 4  # the first speculative step on a fresh worker, before t_verify(K) is known
PROBE_MIN_STEPS = 4
PROBE_MAX_STEPS = 32
DEFAULT_MAX_DRAFT_TOKENS = 8  # the bound of an adaptive K (--max-draft-tokens)
ON_MARGIN = 1.1  # from off, speculation must promise this much more than target-only to turn on
FLOOR_DRIFT = 0.02  # per draft call, the cheapest-guess floor creeps up: it follows a slower machine
SHARED_LOAD = 1.5  # from this load on, every request of a worker prices K at the worker's α
PROBE_MAX_BEHIND = 64  # a probe that would first catch the draft up on more tokens is skipped
PROBE_BUDGET = 0.03  # the share of its target-only time a worker may spend on probes
LOOKUP_ALPHA_PRIOR = 0.5  # prompt lookup before anything is measured: its guesses are often all or nothing
IN_STEP_CURSOR = 2  # a draft in step is sent at most 2 tokens before its guesses (the last guess, the bonus)
AHEAD_MARGIN = 0.02  # draft ahead (auto) only where it promises to save this share of a synchronous step
DECODE_RUN_SECONDS = 0.2  # a target-only step asks for the tokens the target decodes in about this long
MAX_DECODE_RUN = 16  # ... and at most this many (a stream's text still arrives in pieces of a few)


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


class Ewma:
    """Exponentially weighted moving average; None until the first sample."""

    def __init__(self, weight: float, value: float | None = None):
        self.weight = weight
        self.value = value

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


@dataclass(frozen=True)
class PassCost:
    """One batched pass of a service, as it reports it with each call it served."""

    calls: int
    tokens: int  # positions computed: its calls, each padded to the longest where the engine pads
    seconds: float  # compute, no queueing
    sessions: int = 0  # sessions the service held: the streams a pass could carry


class PassTime:
    """A pass's seconds as a + b·tokens, a least-squares fit over recent passes, each weighing
    TIME_WEIGHT more than the one before. Passes all of one size say nothing new about b: it
    keeps what the last spread of sizes said."""

    def __init__(self, weight: float = TIME_WEIGHT):
        self.weight = weight
        self.sums = [0.0] * 5  # of w, w·n, w·n², w·y, w·n·y
        self.a: float | None = None
        self.b = 0.0
        self.sloped = False  # b is measured (two sizes of pass seen), not assumed 0

    def add(self, tokens: int, seconds: float) -> None:
        keep = 1 - self.weight
        self.sums = [
            keep * total + term for total, term in zip(self.sums, (1, tokens, tokens**2, seconds, tokens * seconds))
        ]
        w, n, nn, y, ny = self.sums
        spread = w * nn - n * n
        if spread > 1e-6 * w * nn:
            self.b, self.sloped = max(0.0, (w * ny - n * y) / spread), True
        self.a = max(0.0, (y - self.b * n) / w)

    def seconds(self, tokens: float) -> float:
        return self.a + self.b * tokens


@dataclass
class ServiceCosts:
    """What the pair costs, measured on every call: one per orchestrator worker, shared by its requests."""

    draft_per_token: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT))
    verify_by_k: dict[int, Ewma] = field(default_factory=dict)  # K -> seconds of Verify(K); 0: Decode
    rtt_draft: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT))
    rtt_target: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT))
    alpha: Ewma = field(default_factory=lambda: Ewma(WORKER_ALPHA_WEIGHT, ALPHA_PRIOR))
    target_pass: PassTime = field(default_factory=PassTime)  # the target's batched passes
    target_streams: int = 1  # the load B: streams at the target, as its last pass said
    draft_forward: PassTime = field(default_factory=PassTime)  # seconds of one draft forward by rows (calls)
    draft_catchup: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT))  # seconds per token the draft catches up on
    draft_floor: float | None = None  # the cheapest guess lately: the draft with the cores to itself
    explorer: weakref.ref | None = None  # the request taking a fresh worker's first measurements under load
    probe_budget: float = 0.0  # seconds of probing the worker's target-only steps have paid for
    lookup_alpha: Ewma = field(default_factory=lambda: Ewma(WORKER_ALPHA_WEIGHT, LOOKUP_ALPHA_PRIOR))
    bonus_match: Ewma = field(default_factory=lambda: Ewma(WORKER_ALPHA_WEIGHT, ALPHA_PRIOR))  # β: b == bonus
    ahead_slowdown: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT, 0.0))  # a guess beside a verify / floor - 1
    shared_cores: bool = False  # told: draft and target compute on the same CPU cores (ahead.py share_cores)

    def draft_ahead_pays(self, alpha: float, k: int, k_next: int) -> bool:
        """Whether drafting K' = k_next guesses ahead of a step of K beats waiting for a Propose
        (draft_ahead_gain, at the measured costs, β, and the draft's slowdown beside a verify as the
        share of cores it competes for: all of them where the two are known to share cores). Unknown costs: no."""
        t_draft, t_verify = self.draft_seconds(), self.verify_seconds(k)
        if t_draft is None or t_verify is None:
            return False
        rtt_draft, rtt_target = self.rtt_draft.value or 0.0, self.rtt_target.value or 0.0
        shared = 1.0 if self.shared_cores else min(1.0, max(0.0, self.ahead_slowdown.value or 0.0))
        gain = draft_ahead_gain(
            alpha, self.bonus_match.value, k, k_next, t_draft, t_verify, rtt_draft, rtt_target, shared
        )
        return gain > AHEAD_MARGIN * (k * t_draft + rtt_draft + t_verify + rtt_target)

    def record_ahead(self, per_guess: float) -> None:
        """A guess's time in a call drafted ahead, beside the target's verify: against the cheapest
        guess lately (the draft alone), how much the two slow each other (0: separate cores)."""
        if self.draft_floor:
            self.ahead_slowdown.add(max(0.0, per_guess / self.draft_floor - 1))

    def spend_on_probe(self, behind: int, k: int, draft: bool = True) -> bool:
        """Whether the budget holds a probe of K after `behind` tokens of catch-up (draft: the draft
        model's; else the prompt lookup's, which costs only the longer verify); if so, spend it.
        Every stream pays for it: the longer verify lengthens the pass all B streams wait for
        (t_verify at the load says so), and the draft's catch-up and guesses run beside that pass
        on shared cores (priced B times, as the switch-on is)."""
        cost = self.load() * (self.catchup_seconds(behind) + k * (self.draft_seconds() or 0.0)) if draft else 0.0
        cost += max(0.0, (self.verify_seconds(k) or 0.0) - (self.verify_seconds(0) or 0.0))
        if cost > self.probe_budget:
            return False
        self.probe_budget -= cost
        return True

    def record_target_pass(self, served: PassCost, longest: int) -> None:
        """B is the streams at the target (the sessions it holds or has calls queued for), not only
        those this pass carried: when speculating streams drift apart (some at the draft) passes
        carry fewer calls than target-only would, and pricing K against that smaller batch would
        favour speculation that broke the batch. The latest count, unsmoothed: when load arrives,
        the streams starting now must already see it, or each would start by speculating.
        A pass with a row longer than `longest` (the longest verify: a prefill, a resync) stays out
        of the fit: a prefill runs in calls of its own whose cost per token is not a verify's (in
        llama.cpp's batched kernels a prompt token costs a fraction of a scored position), and one
        such pass would set the slope b for many steps."""
        if served.tokens <= served.calls * longest:
            self.target_pass.add(served.tokens, served.seconds)
        self.target_streams = max(served.calls, served.sessions)

    def record_verify(self, k: int, seconds: float, rtt: float) -> None:
        self.verify_by_k.setdefault(k, Ewma(TIME_WEIGHT)).add(seconds)
        self.rtt_target.add(rtt)

    def record_draft(self, k: int, seconds: float, rtt: float, served: PassCost | None = None) -> None:
        """A Propose of K: its time per guess; the pass's compute when the draft said it (under load
        the call also queued), else the call's. A pass that also carried a longer row (another
        stream's catch-up: every row computes as long as it) says nothing of a guess's time."""
        self.rtt_draft.add(rtt)
        if served and served.tokens > served.calls * (k + IN_STEP_CURSOR):
            return
        per_guess = (served.seconds if served else seconds) / k
        self.draft_per_token.add(per_guess)
        floor = self.draft_floor
        self.draft_floor = per_guess if floor is None else min(per_guess, floor * (1 + FLOOR_DRIFT))
        if served:
            self.draft_forward.add(served.calls, served.seconds / k)

    def record_catchup(self, behind: int, seconds: float, k: int) -> None:
        """A Propose of K that first caught up on `behind` tokens: what it cost beyond K guesses, per token."""
        guesses = k * (self.draft_seconds() or 0.0)
        self.draft_catchup.add(max(0.0, seconds - guesses) / behind)

    def catchup_seconds(self, behind: int) -> float:
        """What the draft's catching up on `behind` tokens costs (until measured: a guess's time each)."""
        per_token = self.draft_catchup.value if self.draft_catchup.value is not None else self.draft_seconds()
        return behind * (per_token or 0.0)

    def load(self) -> float:
        """B: the streams at the target, as it last said (1 before anything is known)."""
        return float(max(1, self.target_streams))

    def draft_seconds(self, calls: float | None = None) -> float | None:
        """t_draft at `calls` rows per draft forward (default: the load), from the fit; else as measured."""
        if self.draft_forward.sloped:
            return self.draft_forward.seconds(self.load() if calls is None else calls)
        return self.draft_per_token.value

    def verify_seconds(self, k: int, calls: float | None = None) -> float | None:
        """t_verify(K) at `calls` calls per pass (default: the load), from the passes' fit (see the
        module's docstring); else measured per K: interpolated between measured K, else extended
        along the last slope."""
        if self.target_pass.sloped:
            return self.target_pass.seconds((self.load() if calls is None else calls) * (k + 1))
        known = sorted((n, e.value) for n, e in self.verify_by_k.items())
        if not known:
            return None
        below = [point for point in known if point[0] <= k]
        above = [point for point in known if point[0] >= k]
        if below and above:
            (k0, t0), (k1, t1) = below[-1], above[0]
            return t0 if k1 == k0 else t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        ends = known[-2:] if below else known[:2]  # extrapolate from the nearest two
        if len(ends) < 2:
            return ends[0][1]  # one point: assume the premise, scoring K + 1 tokens costs one step
        (k0, t0), (k1, t1) = ends
        return max(t0 + max(0.0, (t1 - t0) / (k1 - k0)) * (k - k0), 1e-6)

    def decode_run(self) -> int:
        """Tokens a target-only step asks the target for (a Decode run): as many as it decodes in about
        DECODE_RUN_SECONDS at the load, at most MAX_DECODE_RUN; one until a decode is measured."""
        t_decode = self.verify_seconds(0)
        return max(1, min(MAX_DECODE_RUN, int(DECODE_RUN_SECONDS / t_decode))) if t_decode else 1

    def ready(self) -> bool:
        """Enough to compare speculating with not: a decode, a verify and a draft time."""
        return 0 in self.verify_by_k and len(self.verify_by_k) > 1 and self.draft_per_token.value is not None


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
            decode_run=costs.decode_run(),
        )
