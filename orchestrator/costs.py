"""What the pair costs, measured on every call: one ServiceCosts per orchestrator worker, shared by
its requests, keeps running estimates of α (the draft model's and the prompt lookup's), the draft's
time per guess and per token caught up on, the target's time to verify K, the round trips, and the
load; from them it prices t_draft and t_verify(K) for the K chooser (adaptive.py, pricing.py).

Under load t_verify(K) is priced at the load: the services say, with every batched call, how many
calls the pass that served it carried and how many positions it computed (in transformers each call
padded to the longest: one verify among decodes makes them all K + 1 long; in llama.cpp the calls'
own, whose cost is per position: counted padded, a verify among 7 decodes would say 40 positions for
12 computed, and the slope would price verifying at a third), what it cost and how many sessions the
service holds. The worker prices a pass by its positions on the curve the target measured when it
loaded (ModelInfo.pass_positions: one session's 1..9, 16, 32, 64 and 128 positions), scaled by what
its recent passes cost against that curve (`PassCurve`). With B streams (the sessions held, at least
the calls per pass), every stream drafting K puts B·(K + 1) positions in a pass: t_verify(K) =
pass(B·(K + 1)). Where a pass is dominated by reading the weights (a flat curve: a GPU, or a CPU at
small B), verifying K rides almost free and K stays high; where it is dominated by compute (a CPU
under load), K shrinks and turns off, and turns back on when B falls.

Where the target runs a pass's rows of different lengths as parts of their own (ModelInfo.splits_rows:
llama.cpp with a KV stream per session), a stream's verify among the others' decode steps is a part
of K positions that reads the weights again, and all B streams wait for it: t_verify(K) = pass(B) +
B·pass(K), so a stream drafts only where its accepted guesses come faster than the pass's own tokens.
Measured on the engine (default target, 16 sessions, 2 cores of an AMD EPYC Zen 5): 8 verifies of 5
among 8 decode steps 493 ms with their seq ids side by side, 705 ms alternating, against 176 ms for
the 16 decode steps; priced as one pass of B·(K + 1) positions, the prompt lookup's verifies (α 0.89)
took passes at 16 streams from 14.2 streams to 7.2 and the stack from 67 tok/s target-only to 50.

A target that measured no wide passes (an older service) is fitted as a + b·tokens over recent passes
(`PassTime`). A fit has no shape to go on, and under load it was measured to lose it: passes nearly all
of one size (16 streams' decode steps) with a few slower narrow ones among them (the draft catching
up beside them) drove b to 0 on the default pair at 16 streams, so verifying K = 8 looked free and
every stream drafted it (23 tok/s, against 74 target-only).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from specd.orchestrator.pricing import draft_ahead_gain

ALPHA_PRIOR = 0.7  # before anything is measured: a typical code/chat pair
WORKER_ALPHA_WEIGHT = 0.05  # the worker's average moves slowly: it seeds new requests
TIME_WEIGHT = 0.3  # per measured call: costs follow the load within a few steps
FLOOR_DRIFT = 0.02  # per draft call, the cheapest-guess floor creeps up: it follows a slower machine
LOOKUP_ALPHA_PRIOR = 0.5  # prompt lookup before anything is measured: its guesses are often all or nothing
IN_STEP_CURSOR = 2  # a draft in step is sent at most 2 tokens before its guesses (the last guess, the bonus)
WIDE_PROFILE = 9  # a target profile of wider passes than this (positions) is priced on its curve
AHEAD_MARGIN = 0.02  # draft ahead (auto) only where it promises to save this share of a synchronous step


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


class PassCurve:
    """A pass's seconds by its tokens: the shape the service measured when it loaded (`points`,
    positions -> seconds of one session, interpolated between them and extended along the last
    segment's slope), the level from the passes it serves: each one's seconds against the shape's,
    a running ratio (`scale`, TIME_WEIGHT a pass). One number to learn, which a few slow passes move
    but cannot bend: the ratio of a verify's cost to a decode's stays what the engine measured."""

    sloped = True  # the shape is measured: every size is priced from the first call

    def __init__(self, points: Sequence[tuple[int, float]], weight: float = TIME_WEIGHT):
        self.points = sorted(points)
        self.scale = Ewma(weight, 1.0)

    def shape(self, tokens: float) -> float:
        """The profile's seconds for a pass of `tokens` positions."""
        points = self.points
        if tokens <= points[0][0]:
            return points[0][1]
        right = next((i for i, (n, _) in enumerate(points) if n >= tokens), len(points) - 1)
        (n0, t0), (n1, t1) = points[right - 1], points[right]
        return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)

    def add(self, tokens: int, seconds: float) -> None:
        self.scale.add(seconds / self.shape(tokens))

    def seconds(self, tokens: float) -> float:
        return self.scale.value * self.shape(tokens)


@dataclass
class ServiceCosts:
    """What the pair costs, measured on every call: one per orchestrator worker, shared by its requests."""

    draft_per_token: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT))
    verify_by_k: dict[int, Ewma] = field(default_factory=dict)  # K -> seconds of Verify(K); 0: Decode
    rtt_draft: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT))
    rtt_target: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT))
    alpha: Ewma = field(default_factory=lambda: Ewma(WORKER_ALPHA_WEIGHT, ALPHA_PRIOR))
    target_pass: PassTime | PassCurve = field(default_factory=PassTime)  # the target's batched passes
    target_streams: int = 1  # the load B: streams at the target, as its last pass said
    draft_forward: PassTime = field(default_factory=PassTime)  # seconds of one draft forward by rows (calls)
    draft_catchup: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT))  # seconds per token the draft catches up on
    draft_floor: float | None = None  # the cheapest guess lately: the draft with the cores to itself
    explorer: weakref.ref | None = None  # the request taking a fresh worker's first measurements under load
    probe_budget: float = 0.0  # seconds of probing the worker's target-only steps have paid for
    lookup_alpha: Ewma = field(default_factory=lambda: Ewma(WORKER_ALPHA_WEIGHT, LOOKUP_ALPHA_PRIOR))
    bonus_match: Ewma = field(default_factory=lambda: Ewma(WORKER_ALPHA_WEIGHT, ALPHA_PRIOR))  # β: b == bonus
    ahead_slowdown: Ewma = field(default_factory=lambda: Ewma(TIME_WEIGHT, 0.0))  # a guess beside a verify / floor - 1
    shared_cores: bool = False  # told: draft and target compute on the same CPU cores (remote.py share_cores)
    splits_rows: bool = False  # told: the target runs a verify among decode steps as a part of its own (ModelInfo)

    def seed(
        self,
        draft: Sequence[float],
        target: Sequence[float],
        draft_prefill: float = 0.0,
        target_positions: Sequence[int] = (),
    ) -> None:
        """Start from what the services measured of their passes when they loaded (ModelInfo.pass_seconds,
        model/pass_profile.py: 1, 2, ... positions of one session, then wider passes where
        `target_positions` says so): the target's decode and verify of each K, its pass curve (where it
        measured wide passes, else a fit), the draft's guess and its catch-up per token
        (`draft_prefill`, a prompt's prefill per token; else a catch-up is priced at a guess a token,
        many times its cost), so that a fresh worker's first steps are priced rather than explored
        (speculation off from the first step where verifying costs as much as decoding). The calls'
        own measurements take over as they come, TIME_WEIGHT each."""
        points = list(zip(target_positions or range(1, len(target) + 1), target))
        for positions, seconds in points:
            self.verify_by_k[positions - 1] = Ewma(TIME_WEIGHT, seconds)
        if points and max(points)[0] > WIDE_PROFILE:
            self.target_pass = PassCurve(points)
        else:
            for positions, seconds in points:
                self.target_pass.add(positions, seconds)
        if draft:
            self.draft_per_token = Ewma(TIME_WEIGHT, draft[0])
            self.draft_floor = draft[0]
        if draft_prefill:
            self.draft_catchup = Ewma(TIME_WEIGHT, draft_prefill)

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
            streams = self.load() if calls is None else calls
            if k and self.splits_rows and streams >= 2:  # its guesses a part of their own, which all wait for
                return self.target_pass.seconds(streams) + streams * self.target_pass.seconds(k)
            return self.target_pass.seconds(streams * (k + 1))
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

    def ready(self) -> bool:
        """Enough to compare speculating with not: a decode, a verify and a draft time."""
        return 0 in self.verify_by_k and len(self.verify_by_k) > 1 and self.draft_per_token.value is not None
