"""One request, end to end: the target's first token, then propose -> verify -> commit until done.

Protocol (per request):
  1. The first step is the target's alone: its Decode carries the whole prompt (a call from token
     0 opens the session, docs/architecture.md §3), so the first token costs one pass. The draft
     is opened the same way by its first Propose, when the chooser first drafts.
  2. Step (`Generation.step`): choose K and who guesses (fixed, or adaptive.py's best for the
     measured α and costs of each source); the prompt lookup (lookup.py, no call) or the draft
     proposes K tokens; the target verifies them in one pass and emits accepted + 1 tokens; the
     orchestrator commits them and streams the new text.
  3. Rollback is implicit: each next call starts at the agreed prefix (sessions.py, which alone
     keeps the record of what each service holds).
  4. Finish on max_new_tokens ("length"), EOS or a stop string ("stop"). A client's deadline or
     cancel ends the request without a Finished (DEADLINE_EXCEEDED, or nobody left to read it).
     Both sessions are released whatever happened.
Speculation off (K = 0, asked for or chosen) runs step 2 on the target alone: a Decode run of as
many tokens as it decodes in about 0.2 s (adaptive.py `decode_run`; one on the first step), each fed
back before the next, in one round trip.
The lookup-only drafters (ngram, suffix) never call the draft, so they run without a draft service
too (draft_stub None: an orchestrator started without --draft).
Draft-ahead (ahead.py) sits beside step 2: while the target verifies, the draft guesses the next step
on the assumption that all is accepted; step 1 of the next step takes those guesses when it was.
A draft that is down or slower than its deadline is skipped the same way, step by step (fail
closed, faults.py), and where the pool has other draft replicas the request goes on with one of them
(`move_draft`); an unavailable target is retried, then the request ends UNAVAILABLE (or the pool
moves it to another target replica, migration.py).
The request, its events and its stats are types of their own (request.py).
"""

import asyncio
import logging
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from specd.orchestrator.adaptive import DEFAULT_MAX_DRAFT_TOKENS, SHARED_LOAD, AdaptiveK, decode_run
from specd.orchestrator.ahead import DraftAhead
from specd.orchestrator.costs import ServiceCosts
from specd.orchestrator.faults import DraftGate, FaultPolicy, ServiceFailed
from specd.orchestrator.lookup import LOOKUP_ONLY, PromptLookup
from specd.orchestrator.request import Delta, Finished, GenerationRequest, Rebound, Stats
from specd.orchestrator.sessions import RemoteSession
from specd.orchestrator.suffix import RecentOutputs, SuffixDrafter
from specd.orchestrator.text import OutputText
from specd.proto import tracing
from specd.proto.logprobs import top_logprobs_rows
from specd.v1 import common_pb2, draft_pb2

log = logging.getLogger("specd.orchestrator")

NO_TIME = (0.0, None)  # a call not made: (wall seconds, served seconds)
MOVING_CODES = ("UNAVAILABLE", "CANCELLED")  # a draft failure that moves the request to another draft replica
_releasing: set[asyncio.Task] = set()  # Releases not waited for (a failed service's), kept until they end


@dataclass(frozen=True)
class DraftBinding:
    """A draft replica a request can go on with: its address, stub, the worker's gate for it, and
    the costs of its pair with the request's target."""

    address: str
    stub: object
    gate: DraftGate
    costs: ServiceCosts


class Generation:
    """The orchestrator's state for one request: it alone owns `committed`."""

    def __init__(
        self,
        request: GenerationRequest,
        draft_stub,
        target_stub,
        tokenizer: Tokenizer,
        eos_ids: set[int],
        policy: FaultPolicy = FaultPolicy(),
        draft_gate: DraftGate | None = None,
        costs: ServiceCosts | None = None,
        trace_parent=None,
        recent: RecentOutputs | None = None,
        rebind: Callable[[str], Awaitable[DraftBinding | None]] | None = None,
    ):
        self.request = request
        self.policy = policy
        # another draft replica to go on with when this one fails (the worker's; None: stay, target-only)
        self.rebind = rebind
        self.rebound: list[Rebound] = []  # moves made, for the pool's router (run yields them)
        self.left: list[RemoteSession] = []  # sessions on draft replicas it left: released at the end
        self.failed_service = ""  # the service whose failure ended the request: its Release is not waited for
        self.trace_parent = trace_parent  # the caller's trace context (tracing.parent); None: a trace of its own
        # prompt + emitted output: the truth (after what an earlier attempt streamed, where it was moved)
        self.committed = list(request.prompt_ids) + list(request.resumed)
        if draft_stub is None and request.drafter not in LOOKUP_ONLY:
            raise ValueError(f"drafter {request.drafter!r} needs a draft service, and there is none (core.py)")
        session_id = request.session_id or uuid.uuid4().hex
        self.draft_gate = draft_gate or DraftGate(policy)  # shared by a worker's requests
        salt = request.cache_salt  # the services' prefix caches: this tenant's prefixes only
        self.draft = RemoteSession(draft_stub, session_id, self.seconds_left, "draft", policy, False, salt)
        self.target = RemoteSession(target_stub, session_id, self.seconds_left, "target", policy, salt=salt)
        if request.failover:  # another replica can take it over: give a failing or frozen target up sooner
            self.target.failover()
        self.sampling = common_pb2.SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=request.logit_bias,
            prompt_tokens=len(request.prompt_ids),  # where the output begins, for the penalties
        )
        self.output = OutputText(tokenizer, request.stop)
        self.output.add(list(request.resumed))  # streamed by the attempt before: its text is out already
        self.eos_ids = set() if request.ignore_eos else eos_ids
        self.costs = costs or ServiceCosts()  # shared by a worker's requests
        adaptive = request.draft_tokens is None
        self.chooser = AdaptiveK(self.costs, request.max_draft_tokens) if adaptive else None
        self.stats = Stats(
            draft_tokens=request.max_draft_tokens if adaptive else request.draft_tokens,
            adaptive=adaptive,
            drafter=request.drafter,
            target=request.target,
            draft=request.draft,
        )
        # The guesses that cost no model: over the committed tokens (and the worker's recent outputs)
        self.recent = recent  # shared by a worker's requests: this one's output joins it when it ends
        self.lookup = None
        if request.drafter == "ngram":
            self.lookup = PromptLookup()
        elif request.drafter != "model":  # suffix, and hybrid's lookup source (it measured the better)
            # Other requests' outputs only when greedy: a seeded sample stays a function of the request alone
            # (the guesses decide which draws are made, docs/architecture.md §3 rule 4)
            self.lookup = SuffixDrafter(recent if request.temperature <= 0 else None, salt=request.cache_salt)
        if self.lookup:
            self.lookup.extend(self.committed)
        self.draft_in_step = True  # the draft holds all but the last step's tokens: its time is a pure K-token time
        self.lookup_offered = False  # the lookup had guesses this step (taken or not)
        self.ahead = DraftAhead(self, request.draft_ahead)  # the next step's guesses, drafted during a verify

    @property
    def speculating(self) -> bool:
        return self.chooser is not None or self.request.draft_tokens > 0

    @property
    def generated(self) -> int:
        return len(self.committed) - len(self.request.prompt_ids)

    def seconds_left(self) -> float | None:
        return None if self.request.deadline is None else max(0.001, self.request.deadline - time.time())

    async def run(self):
        """Yield Delta events, then one Finished."""
        started = time.perf_counter()
        request = self.request  # its span is not made current: the steps may run in different tasks
        self.span = tracing.start_span(
            "specd.request",
            self.trace_parent,
            session_id=self.target.session_id,
            drafter=request.drafter,
            max_new_tokens=request.max_new_tokens,
            prompt_tokens=len(request.prompt_ids),
        )
        try:
            reason = None
            while reason is None:
                with tracing.span("step", self.span, session_id=self.target.session_id):
                    emitted, reason, verdict = await self.step()
                text = self.output.add(emitted)
                if self.output.stopped:
                    reason = "stop"
                if reason:
                    text += self.output.finish()
                if self.stats.steps == 1:
                    self.stats.time_to_first_token_s = time.perf_counter() - started
                while self.rebound:
                    yield self.rebound.pop(0)
                yield self.delta(text, emitted, verdict)
            yield self.finished(reason, time.perf_counter() - started)
        except ServiceFailed as failure:
            self.failed_service = failure.service
            raise
        finally:
            if self.recent is not None:  # what the target committed, however the request ended
                self.recent.add(self.committed[len(request.prompt_ids) :], request.cache_salt)
            with tracing.current(self.span):  # the Release calls belong to the request's trace
                await asyncio.shield(self.release())
            self.span.end()

    def finished(self, reason: str, seconds: float) -> Finished:
        tracing.annotate(self.span, completion_tokens=self.generated, finish_reason=reason)
        self.stats.total_seconds = seconds
        self.stats.completion_tokens = self.generated
        self.stats.resyncs = self.draft.resyncs + self.target.resyncs
        prompt_tokens = len(self.request.prompt_ids)
        cached = min(self.target.cached_prompt_tokens or 0, prompt_tokens)  # the prompt's, not a resync's output
        return Finished(reason, prompt_tokens, self.generated, self.stats, self.request.seed, cached)

    def delta(self, text: str, emitted: list[int], verdict) -> Delta:
        """The step's Delta, with the target's log-probabilities of the committed tokens when asked."""
        delta = Delta(text, emitted)
        if self.request.logprobs:
            delta.logprobs = list(verdict.logprobs[: len(emitted)])
            delta.top_logprobs = top_logprobs_rows(verdict.top_logprobs[: len(emitted)])
            delta.prompt_logprobs = list(verdict.prompt_logprobs)
            delta.prompt_top_logprobs = top_logprobs_rows(verdict.prompt_top_logprobs)
        return delta

    def logprob_options(self) -> dict:
        """The VerifyRequest/DecodeRequest fields that ask the target for log-probabilities; the
        prompt's on the first step only (a Decode from token 0, which opens the session)."""
        if not self.request.logprobs:
            return {}
        options = dict(return_logprobs=True, top_logprobs=self.request.top_logprobs)
        if self.request.prompt_logprobs and self.stats.steps == 0:
            options["prompt_logprobs"] = True
        return options

    async def step(self) -> tuple[list[int], str | None, object]:
        """One step: propose -> verify -> commit. Returns the committed tokens, a finish reason (None: go on)
        and the target's reply (its log-probabilities)."""
        committed = self.committed
        # 1. Propose: K guesses after the committed tokens: those drafted ahead during the last verify
        #    when they continue the committed tokens (ahead.py); else from the prompt lookup where the
        #    text already holds a continuation worth more (no call), else from the draft. No guesses
        #    when K is 0 or the draft is down or slow: then the step runs target-only (fail closed).
        pre_drafted = await self.ahead.take(committed)
        if self.draft_gate.is_down() and self.request.spare_drafts:  # its draft replica is down: go on with another
            await self.move_draft()
        behind = self.draft.behind(committed)
        k, looked_up = (len(pre_drafted[0].draft_tokens), []) if pre_drafted else self.draft_length(behind)
        if pre_drafted:
            proposal, draft_time = pre_drafted
        elif looked_up:
            proposal, draft_time = self.looked_up(looked_up), NO_TIME
        else:
            proposal, draft_time = await self.propose(committed, k)
        guesses = [] if proposal is None else list(proposal.draft_tokens)
        # 2. Verify: the target scores the committed tail and the guesses in one pass, keeps the
        #    longest prefix it agrees with and adds one token of its own (recovered or bonus); with
        #    no guesses it decodes on alone for a run of tokens. Rejected guesses need no message:
        #    each service truncates to the agreed prefix on its next call (sessions.py).
        caught_up = self.target.behind(committed)  # > 0: this call also prefills (or resyncs) first
        if guesses and not looked_up:  # beside the verify: the next step's guesses, if it pays (ahead.py)
            self.ahead.start(committed, guesses, len(guesses))
        started = time.perf_counter()
        with tracing.span("verify" if guesses else "decode", k=len(guesses)):
            if guesses:
                verdict, served = await self.target.verify(
                    committed, guesses, proposal.q, self.sampling, **self.logprob_options()
                )
            else:
                verdict, served = await self.target.decode(
                    committed, self.sampling, **self.run_options(), **self.logprob_options()
                )
        # 3. Record what the step cost and kept (the stats, and what the K chooser learns from).
        verify_time = (time.perf_counter() - started, served)
        looked_up, pre_drafted = bool(looked_up), bool(pre_drafted)
        emitted = list(verdict.emitted_tokens)
        self.record(
            len(guesses),
            verdict.accepted,
            draft_time,
            verify_time,
            behind,
            looked_up,
            caught_up,
            pre_drafted,
            len(emitted),
        )
        # 4. Commit what the target emitted, cut at EOS or the token budget.
        return *self.commit(emitted), verdict

    def draft_length(self, behind: int = 0) -> tuple[int, list[int]]:
        """K for this step and, where the prompt lookup guesses, its K guesses (else the draft's K):
        fixed, or the chooser's (`behind`: tokens the draft would first catch up on); never more
        than the tokens left minus the target's own; 0 for the first step (the first token comes
        from the target alone). A fixed K takes the lookup's guesses when it has K of them (an
        `ngram` or `suffix` request: whatever it has, up to K)."""
        request, left = self.request, self.request.max_new_tokens - self.generated
        self.lookup_offered = False
        if self.stats.steps == 0:
            return 0, []
        most = request.max_draft_tokens if self.chooser else request.draft_tokens
        found = self.lookup.propose(most) if self.lookup else []
        self.lookup_offered = bool(found)
        model = request.drafter not in LOOKUP_ONLY
        if self.chooser:
            k = self.chooser.lookup_k(left, len(found), behind, model) if found else 0
            if k or not model:
                return k, found[:k]
            return self.chooser.next_k(left, behind), []
        k = max(0, min(request.draft_tokens, left - 1))
        if not model or (k and len(found) >= k):
            return min(k, len(found)), found[:k]
        return k, []

    def run_options(self) -> dict:
        """The DecodeRequest fields of a target-only step: a run of the tokens the target decodes in
        about DECODE_RUN_SECONDS (adaptive.py), never past the token budget, ending at EOS. One token
        on the first step (its prefill's time says nothing of a decode's yet, and the first token
        should stream at once), and where a lone stream's lookup had guesses it was not worth
        verifying: it looks again after the next token (a run would pass over its chances). Under
        load (SHARED_LOAD) a verify is priced for every stream that waits for it and the lookup
        rarely pays: there a run of one token would only pay a round trip a token (default `specd
        up`, Zen 5, the default prompts: 4-7 % under --no-speculation at 2-8 streams with the run
        kept, 4-12 % with one token)."""
        left = self.request.max_new_tokens - self.generated
        single = self.stats.steps == 0 or (self.lookup_offered and self.costs.load() < SHARED_LOAD)
        steps = 1 if single else max(1, min(decode_run(self.costs), left))
        return dict(steps=steps, stop_token_ids=sorted(self.eos_ids)) if steps > 1 else {}

    def looked_up(self, guesses: list[int]) -> draft_pb2.ProposeResponse:
        """The prompt lookup's guesses as a draft's reply; deterministic, so when sampling each q row is one-hot."""
        one = struct.pack("<f", 1.0)
        greedy = self.sampling.temperature <= 0
        q = [] if greedy else [draft_pb2.SparseDistribution(token_ids=[x], probs=one) for x in guesses]
        return draft_pb2.ProposeResponse(draft_tokens=guesses, q=q)

    async def propose(self, committed: list[int], k: int) -> tuple:
        """(the draft's reply, (wall seconds, served seconds)), or (None, NO_TIME) when it is not asked or fails.

        Fail closed: a draft failure costs this step its guesses, never a token, since the target
        decides every token either way; the gate keeps the worker's requests off it for a while.
        """
        if not (k and self.draft_gate.is_open()):
            return None, NO_TIME
        started = time.perf_counter()
        try:
            with tracing.span("propose", k=k):
                proposal, served = await self.draft.propose(committed, k, self.sampling)
        except ServiceFailed as failure:
            if self.draft.spent():
                raise  # the request ran out of time, not the draft: end it (DEADLINE_EXCEEDED)
            self.draft_failed(failure)
            log.warning("draft failed, this step runs target-only: %s", failure)
            return None, NO_TIME
        self.draft_gate.succeeded()
        self.ahead.propose_took(len(proposal.draft_tokens), time.perf_counter() - started)
        return proposal, (time.perf_counter() - started, served)

    def draft_failed(self, failure: ServiceFailed) -> None:
        """A Propose failed (not for the request's deadline): the worker's gate for that draft closes, and
        where it is down or silent the worker's requests leave it before their next Propose (`move_draft`)."""
        self.draft_gate.failed(lost=failure.code.name in MOVING_CODES)

    async def move_draft(self) -> None:
        """Go on with another draft replica where the worker finds one that serves (the session there
        opens from token 0 at the next Propose); none: stay, target-only while the gate is closed. The
        pool hears of it (a Rebound) and routes no new request to the failed one until it serves again."""
        other = await self.rebind(self.stats.draft) if self.rebind else None
        if other is None:
            return
        old = self.draft
        self.left.append(old)
        self.draft = RemoteSession(other.stub, old.session_id, self.seconds_left, "draft", self.policy, False, old.salt)
        self.draft_gate, self.costs = other.gate, other.costs
        if self.chooser:
            self.chooser.costs = other.costs
        self.rebound.append(Rebound(self.stats.draft, other.address))
        log.warning("draft replica %s failed: the request goes on with %s", self.stats.draft, other.address)
        self.stats.draft = other.address
        self.stats.draft_moves += 1

    def record(
        self,
        k: int,
        accepted: int,
        draft: tuple,
        verify: tuple,
        behind: int = 0,
        lookup: bool = False,
        target_behind: int = 0,
        pre_drafted: bool = False,
        emitted: int = 1,
    ) -> None:
        """Stats, and the measurements the K chooser lives on. Each call: (wall seconds, served seconds
        or None); behind: the tokens the draft caught up on first; lookup: the prompt lookup guessed
        (no draft call: the draft falls behind by the step's tokens); target_behind: the tokens the
        target caught up on first (the prompt, on the first step): that call's time is a prefill's,
        not a decode's or a verify's, and says nothing of t_verify(K); pre_drafted: the guesses were
        drafted ahead (ahead.py), so the step's draft time is a wait, not a Propose's; emitted: the
        tokens the target answered (a target-only step's run: t_verify(0) is a decode's, per token)."""
        self.stats.record_times(*draft, *verify)
        self.stats.record_step(k, accepted, lookup)
        draft_s, verify_s, network_s = self.stats.step_seconds[-1]
        draft_rtt = draft[0] - draft_s
        if not target_behind:
            self.costs.record_verify(k, verify_s / (1 if k else emitted), network_s - draft_rtt)
        if self.target.last_pass:
            longest = max(self.stats.draft_tokens, DEFAULT_MAX_DRAFT_TOKENS) + 1  # any verify's row
            self.costs.record_target_pass(self.target.last_pass, longest)
        if k and not lookup and not pre_drafted:  # after target-only (or lookup) steps it also caught up on theirs
            if self.draft_in_step:
                self.costs.record_draft(k, draft_s, draft_rtt, self.draft.last_pass)
            elif behind:
                self.costs.record_catchup(behind, draft[0], k)
        if k and self.chooser:
            self.chooser.observe(k, accepted, lookup)
        elif self.chooser:
            self.chooser.decoded_run(emitted)
        self.draft_in_step = k > 0 and not lookup
        tracing.annotate(  # the step's span
            k=k,
            accepted=accepted,
            lookup=lookup,
            draft_seconds=draft_s,
            verify_seconds=verify_s,
            network_seconds=network_s,
        )

    def commit(self, emitted: list[int]) -> tuple[list[int], str | None]:
        """Append emitted tokens, cut at EOS or the token budget; returns them and a finish reason or None."""
        budget = self.request.max_new_tokens - self.generated
        eos_at = next((i for i, token in enumerate(emitted) if token in self.eos_ids), None)
        stop = eos_at is not None and eos_at < budget
        kept = emitted[: eos_at + 1] if stop else emitted[:budget]
        self.committed += kept
        if self.lookup:
            self.lookup.extend(kept)
        if stop:
            return kept, "stop"
        return kept, "length" if self.generated >= self.request.max_new_tokens else None

    async def release(self) -> None:
        # Best effort: idle eviction frees whatever a dead service could not release. A service that
        # failed the request is not waited for (a frozen one would hold the request's end, and its move
        # to another replica, for the Release's timeout).
        await self.ahead.discard()  # a call drafting ahead ends before its session does
        sessions = {"draft": self.draft, "target": self.target}
        waited = [session.release(self.committed) for name, session in sessions.items() if name != self.failed_service]
        later = [session.release() for session in self.left]
        if self.failed_service in sessions:
            later.append(sessions[self.failed_service].release())
        if later:
            task = asyncio.ensure_future(asyncio.gather(*later, return_exceptions=True))
            _releasing.add(task)
            task.add_done_callback(_releasing.discard)
        await asyncio.gather(*waited, return_exceptions=True)
