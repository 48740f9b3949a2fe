"""Draft ahead: the draft guesses step n+1 while the target verifies step n, so a remote draft's time
and round trip hide behind verification (issue 20; the idea of SpecEdge, PEARL, AMUSD and PipeSpec).

Protocol, beside `Generation.step` (generation.py), for a step whose K guesses g1..gK came from the
draft model:
  1. `start`, as the Verify is sent: ask the draft, in the background, for K' + 1 tokens continuing
     committed + g1..gK: its own guess b for the bonus position first, then K' guesses for step n+1.
     b rides in this call, behind the verify, rather than making step n's own Propose K + 1 long
     (which every step would wait for, drafting ahead or not).
  2. `take`, at the start of step n+1: the committed tokens are then committed + g1..g(accepted) + the
     target's token. If all K were accepted and the target's token is b, they are exactly the context
     the pre-draft continued, and its K' guesses (their q rows when sampling: each drawn at its own
     position, docs/architecture.md §3 rule 4) are step n+1's, without a Propose. Otherwise they are
     discarded: the draft's extra KV is rolled back by the next cursor, as after any rejection (§3
     rule 2). A call that may or may not have run leaves the record at what the draft held before
     it, a prefix of either outcome, so the next cursor holds in both cases.
  3. One draft call per session at a time: `take` settles the pre-draft (used, or cancelled and
     awaited) before the step makes any other draft call, and `discard` runs before Release.
  4. Never block on a slow or dead draft: a usable pre-draft not back at the verdict is waited for as
     long as a fresh Propose sent then would take (this request's last), or until it has run twice
     its expected time, then cancelled; a failure closes the draft gate as a Propose's would (fail
     closed, faults.py).
Exactness is untouched: the target verifies every guess, wherever it came from.

`--draft-ahead on|off|auto` (per request: GenerateRequest.draft_ahead): auto drafts ahead where
ServiceCosts.draft_ahead_pays (costs.py) says the expected hidden time beats the work it wastes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from specd.orchestrator.costs import ServiceCosts
from specd.orchestrator.faults import DraftGate, ServiceFailed
from specd.proto import tracing
from specd.v1 import draft_pb2

log = logging.getLogger("specd.orchestrator")

DRAFT_AHEAD_MODES = ("auto", "on", "off")
DEFAULT_DRAFT_AHEAD = "auto"
MIN_WAIT_S = 0.001


@dataclass
class PreDraft:
    """One call drafting ahead, in flight or answered."""

    context: list[int]  # committed + g1..gK: what it continues
    asked: int  # K' + 1: the bonus guess, then step n+1's
    fresh_s: float  # what a Propose of K' took this request: the most a late pre-draft is waited for
    task: asyncio.Task
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None  # when its reply (or failure) came


class Drafting(Protocol):
    """What drafting ahead reads of its request's Generation (generation.py), which owns it: the draft
    session, gate and costs it drafts with now (a request may move to another draft replica), the K
    chooser, the sampling, the stats it counts in, the request and its end tokens."""

    request: object  # GenerationRequest
    draft: object  # RemoteSession
    draft_gate: DraftGate
    costs: ServiceCosts
    chooser: object  # AdaptiveK, or None for a fixed K
    sampling: object  # common_pb2.SamplingParams
    stats: object  # request.py Stats
    eos_ids: set[int]

    def draft_failed(self, failure: ServiceFailed) -> None: ...


class DraftAhead:
    """One request's drafting ahead: at most one pre-draft at a time, and its stats."""

    def __init__(self, generation: Drafting, mode: str = DEFAULT_DRAFT_AHEAD):
        self.generation = generation  # the Generation that owns it (a back-reference: Drafting says what it reads)
        self.mode = mode
        self.pending: PreDraft | None = None
        self.last_propose_s = 0.0  # wall seconds of this request's last fresh Propose, per guess

    def propose_took(self, k: int, wall_s: float) -> None:
        """A fresh Propose of K took wall_s: the yardstick for waiting on a late pre-draft."""
        if k:
            self.last_propose_s = wall_s / k

    def start(self, committed: list[int], guesses: list[int], k: int) -> None:
        """After the Verify of `guesses` (the draft model's) is sent: draft step n+1 ahead, where it pays."""
        gen = self.generation
        k_next = self._next_k(committed, guesses, k)
        if not (k_next and gen.draft_gate.is_open()):
            return
        if self.mode == "auto":
            measured = gen.stats.acceptance_rate if gen.stats.drafted else gen.costs.alpha.value
            alpha = gen.chooser.model_alpha() if gen.chooser else measured
            if not gen.costs.draft_ahead_pays(alpha, k, k_next):
                return
        context = committed + guesses
        task = asyncio.ensure_future(self._draft(context, k_next + 1))
        self.pending = PreDraft(context, k_next + 1, self.last_propose_s * k_next, task)
        task.add_done_callback(lambda _, pending=self.pending: setattr(pending, "finished", time.perf_counter()))
        gen.stats.ahead_steps += 1

    async def take(self, committed: list[int]) -> tuple | None:
        """The pre-draft as this step's (ProposeResponse, (wall, served) seconds waited), when it
        continues exactly `committed`; else None, with the pre-draft settled (cancelled, or answered)."""
        pending = self.pending  # cleared once settled: a request cancelled meanwhile still discards it
        if pending is None:
            return None
        if committed[:-1] != pending.context:  # not all K accepted (or cut at EOS): no use for it
            return await self._waste(pending)
        waited_from = time.perf_counter()
        if not pending.task.done():  # all accepted: b decides, and it is not back yet
            await asyncio.wait({pending.task}, timeout=self._patience(pending, waited_from))
        reply = pending.task.result() if pending.task.done() else None
        if reply is None or len(reply.draft_tokens) < 2:
            return await self._waste(pending)
        gen, waited = self.generation, time.perf_counter() - waited_from
        gen.costs.bonus_match.add(float(reply.draft_tokens[0] == committed[-1]))
        if reply.draft_tokens[0] != committed[-1]:
            return await self._waste(pending)
        gen.stats.ahead_ready += 1
        gen.stats.ahead_late += waited > MIN_WAIT_S
        gen.stats.ahead_wasted_tokens += 1  # b: checked against the target's token, never verified
        # A task can be done before its done-callbacks (the one that sets `finished`) have run
        finished = pending.finished if pending.finished is not None else time.perf_counter()
        gen.stats.ahead_hidden_seconds += max(0.0, finished - pending.started - waited)
        self.pending = None
        guesses = draft_pb2.ProposeResponse(draft_tokens=reply.draft_tokens[1:], q=reply.q[1:])
        return guesses, (waited, waited)

    async def discard(self) -> None:
        """Cancel a pre-draft still in flight and wait until it is settled (before a Release)."""
        if self.pending is not None:
            await self._waste(self.pending)

    async def _waste(self, pending: PreDraft) -> None:
        """Cancel the pre-draft (a no-op when answered) and wait until it is settled."""
        pending.task.cancel()
        await asyncio.wait({pending.task})  # unlike awaiting it, lets this request's own cancellation through
        self.pending = None
        self.generation.stats.ahead_wasted_tokens += pending.asked
        return None

    def _patience(self, pending: PreDraft, now: float) -> float:
        """How long to wait for a usable pre-draft: as long as a fresh Propose sent now would take, or
        until it has run twice its expected time (its K' + 1 guesses at this request's pace), if later:
        by then it has most likely almost arrived, unless the draft is stuck."""
        expected = pending.fresh_s * pending.asked / max(1, pending.asked - 1)
        return max(MIN_WAIT_S, pending.fresh_s, pending.started + 2 * expected - now)

    def _next_k(self, committed: list[int], guesses: list[int], k: int) -> int:
        """K' for step n+1 if all K are accepted: this step's K, within the tokens then left (the
        target adds one of its own) and what one Propose may ask (K' + 1 tokens); 0: do not draft ahead."""
        gen = self.generation
        request = gen.request
        if self.mode == "off" or not guesses or any(token in gen.eos_ids for token in guesses):
            return 0
        left = request.max_new_tokens - (len(committed) - len(request.prompt_ids)) - (k + 1)
        limit = request.max_propose_tokens or (request.max_draft_tokens if gen.chooser else request.draft_tokens)
        return max(0, min(k, left - 1, limit - 1))

    async def _draft(self, context: list[int], asked: int):
        """The background Propose; its reply, or None when the draft failed (the gate then closes)."""
        gen = self.generation
        draft, step_pass = gen.draft, gen.draft.last_pass
        started = time.perf_counter()
        try:
            with tracing.span("propose_ahead", k=asked):
                reply, served = await draft.propose(context, asked, gen.sampling)
        except ServiceFailed as failure:
            if not draft.spent():
                gen.draft_failed(failure)
                log.warning("draft failed while drafting ahead; the next step proposes afresh: %s", failure)
            return None
        finally:
            ahead_pass, draft.last_pass = draft.last_pass, step_pass  # the step's record reads its own Propose's
        gen.draft_gate.succeeded()
        compute = ahead_pass.seconds if ahead_pass else (served or time.perf_counter() - started)
        gen.costs.record_ahead(compute / asked)
        return reply
