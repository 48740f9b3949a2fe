"""One request, end to end: prefill both services, then guess -> verify -> commit until done.

Protocol (per request):
  1. Prefill: both services cache the prompt minus its last token (in parallel).
  2. Step: choose K (fixed, or adaptive.py's best for the measured α and costs); the draft
     proposes K tokens; the target verifies them in one pass and emits accepted + 1 tokens;
     the orchestrator commits them and streams the new text.
  3. Rollback is implicit: each next call starts at the agreed prefix (sessions.py).
  4. Finish on max_new_tokens, EOS, a stop string, the deadline or a cancel; release both
     sessions whatever happened.
Speculation off (K = 0, asked for or chosen) runs step 2 as a plain decode on the target alone.
A draft that is down or slower than its deadline is skipped the same way, step by step (fail
closed, faults.py); an unavailable target is retried, then the request ends UNAVAILABLE.
"""

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from specd.proto.contract import SERVICE_SECONDS_KEY
from specd.orchestrator.adaptive import AdaptiveK, ServiceCosts
from specd.orchestrator.faults import DraftGate, FaultPolicy, ServiceFailed
from specd.orchestrator.sessions import RemoteSession
from specd.orchestrator.text import OutputText
from specd.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger("specd.orchestrator")


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    draft_tokens: int | None = None  # K; 0 = speculation off; None = chosen every step (adaptive.py)
    max_draft_tokens: int = 8  # the largest K an adaptive request may choose
    ignore_eos: bool = False
    deadline: float | None = None  # time.time() by which the request must end
    session_id: str = ""  # the services' session id (the pool sets it, to release it if a worker dies)


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Finished:
    reason: str  # "length", "stop", "deadline"
    prompt_tokens: int
    completion_tokens: int
    stats: "Stats"


@dataclass
class Stats:
    draft_tokens: int = 0  # the fixed K, or the largest K when adaptive
    adaptive: bool = False
    steps: int = 0
    drafting_steps: int = 0  # steps that verified >= 1 draft token (vLLM's num_drafts)
    drafted: int = 0
    accepted: int = 0
    draft_lengths: list[int] = field(default_factory=list)  # K of each step (0: target-only)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0  # wall seconds of the draft calls
    verify_seconds: float = 0.0  # wall seconds of the target calls
    network_seconds: float = 0.0  # of those, the part not spent inside the services
    step_seconds: list[tuple[float, float, float]] = field(default_factory=list)  # per step: draft, verify, network
    total_seconds: float = 0.0
    time_to_first_token_s: float = 0.0
    completion_tokens: int = 0
    resyncs: int = 0

    def record_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.draft_lengths.append(drafted)
        self.drafting_steps += drafted > 0
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(0, grow)
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def record_times(self, draft_wall: float, draft_served: float | None, verify_wall: float,
                     verify_served: float | None) -> None:
        """One step's call times: wall (round trip) and served (inside the service, None if unsaid)."""
        draft = draft_wall if draft_served is None else min(draft_served, draft_wall)
        verify = verify_wall if verify_served is None else min(verify_served, verify_wall)
        network = draft_wall - draft + verify_wall - verify
        self.draft_seconds += draft_wall
        self.verify_seconds += verify_wall
        self.network_seconds += network
        self.step_seconds.append((draft, verify, network))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.total_seconds if self.total_seconds else 0.0

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.draft_seconds - self.verify_seconds)


class Generation:
    """The orchestrator's state for one request: it alone owns `committed`."""

    def __init__(self, request: GenerationRequest, draft_stub, target_stub, tokenizer: Tokenizer, eos_ids: set[int],
                 policy: FaultPolicy = FaultPolicy(), draft_gate: DraftGate | None = None,
                 costs: ServiceCosts | None = None):
        self.request = request
        self.committed = list(request.prompt_ids)  # prompt + emitted output: the truth
        session_id = request.session_id or uuid.uuid4().hex
        self.policy = policy
        self.draft_gate = draft_gate or DraftGate(policy)  # shared by a worker's requests
        self.draft = RemoteSession(draft_stub, session_id, self.seconds_left, "draft", policy, required=False)
        self.target = RemoteSession(target_stub, session_id, self.seconds_left, "target", policy)
        self.sampling = common_pb2.SamplingParams(
            temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, seed=request.seed
        )
        self.output = OutputText(tokenizer, request.stop)
        self.eos_ids = set() if request.ignore_eos else eos_ids
        self.costs = costs or ServiceCosts()  # shared by a worker's requests
        adaptive = request.draft_tokens is None
        self.chooser = AdaptiveK(self.costs, request.max_draft_tokens) if adaptive else None
        self.stats = Stats(draft_tokens=request.max_draft_tokens if adaptive else request.draft_tokens,
                           adaptive=adaptive)
        self.draft_in_step = True  # the draft holds all but the last step's tokens: its time is a pure K-token time

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
        try:
            await self.prefill()
            reason = None
            while reason is None:
                emitted = await self.step()
                reason = self.commit(emitted)
                text = self.output.add(emitted)
                if self.output.stopped:
                    reason = "stop"
                if reason:
                    text += self.output.finish()
                if self.stats.steps == 1:
                    self.stats.time_to_first_token_s = time.perf_counter() - started
                yield Delta(text, emitted)
            yield self.finished(reason, time.perf_counter() - started)
        finally:
            await asyncio.shield(self.release())

    def finished(self, reason: str, seconds: float) -> Finished:
        self.stats.total_seconds = seconds
        self.stats.completion_tokens = self.generated
        self.stats.resyncs = self.draft.resyncs + self.target.resyncs
        return Finished(reason, len(self.request.prompt_ids), self.generated, self.stats)

    async def prefill(self) -> None:
        drafting = self.speculating and self.draft_gate.is_open()
        self.draft.lost = not drafting  # a draft skipped now is prefilled when it is first asked
        await asyncio.gather(self.target.prefill(self.committed[:-1]), *([self.prefill_draft()] if drafting else []))

    async def prefill_draft(self) -> None:
        """The draft is optional: if it fails, steps run target-only until it is back (then it is resynced)."""
        try:
            await self.draft.prefill(self.committed[:-1])
        except ServiceFailed as failure:
            self.draft.lost = True
            self.draft_gate.failed()
            log.warning("draft prefill failed, continuing target-only: %s", failure)

    async def step(self) -> list[int]:
        """One step: speculative, or target-only when K is 0 or the draft is down or slow.

        Fail closed: a draft failure costs this step its guesses, never a token, since the target
        decides every token either way.
        """
        k = self.draft_length()
        if not (k and self.draft_gate.is_open()):
            return await self.decode_step()
        try:
            emitted = await self.speculative_step(k)
        except ServiceFailed as failure:
            if failure.service != "draft":
                raise
            self.draft_gate.failed()
            log.warning("draft failed, this step runs target-only: %s", failure)
            return await self.decode_step()
        self.draft_gate.succeeded()
        return emitted

    def draft_length(self) -> int:
        """K for this step: fixed, or the chooser's; never more than the tokens left minus the target's own."""
        left = self.request.max_new_tokens - self.generated
        if self.chooser:
            return self.chooser.next_k(left)
        return max(0, min(self.request.draft_tokens, left - 1))

    async def speculative_step(self, k: int) -> list[int]:
        """Guess -> verify. Returns the emitted tokens (accepted guesses + the target's own)."""
        committed = self.committed
        # 1. Propose: the draft guesses K tokens after the committed ones.
        started = time.perf_counter()
        proposal, draft_served = await self.draft.call(committed, lambda cursor: served(self.draft.stub.Propose(
            draft_pb2.ProposeRequest(cursor=cursor, num_draft_tokens=k, sampling=self.sampling),
            timeout=self.draft.timeout(self.policy.propose_timeout_s))))
        self.draft.mirror = committed + list(proposal.draft_tokens[:-1])  # the last guess has no KV
        # 2. Verify: the target scores the tail and all K guesses in one pass, keeps the longest
        #    prefix it agrees with and adds one token of its own (recovered or bonus).
        verified = time.perf_counter()
        verdict, verify_served = await self.target.call(committed, lambda cursor: served(self.target.stub.Verify(
            target_pb2.VerifyRequest(cursor=cursor, draft_tokens=proposal.draft_tokens, q=proposal.q,
                                     sampling=self.sampling), timeout=self.target.timeout())))
        emitted = list(verdict.emitted_tokens)
        self.target.mirror = committed + emitted[:-1]
        # 3. Rollback needs no message: both services truncate to the agreed prefix on their
        #    next call, so rejected guesses vanish there. 4. Record what it cost and gave.
        self.record(k, verdict.accepted, (verified - started, draft_served), (time.perf_counter() - verified, verify_served))
        return emitted

    async def decode_step(self) -> list[int]:
        """Speculation off: one token from the target alone."""
        committed = self.committed
        started = time.perf_counter()
        reply, decode_served = await self.target.call(committed, lambda cursor: served(self.target.stub.Decode(
            target_pb2.DecodeRequest(cursor=cursor, sampling=self.sampling), timeout=self.target.timeout())))
        self.target.mirror = list(committed)
        self.record(0, 0, (0.0, None), (time.perf_counter() - started, decode_served))
        return list(reply.emitted_tokens)

    def record(self, k: int, accepted: int, draft: tuple[float, float | None], verify: tuple[float, float | None]) -> None:
        """Stats, and the measurements the K chooser lives on. Each call: (wall seconds, served seconds or None)."""
        self.stats.record_times(*draft, *verify)
        self.stats.record_step(k, accepted)
        draft_s, verify_s, network_s = self.stats.step_seconds[-1]
        draft_rtt = draft[0] - draft_s
        self.costs.record_verify(k, verify_s, network_s - draft_rtt)
        if k and self.draft_in_step:  # after target-only steps the call also caught up on their tokens
            self.costs.record_draft(k, draft_s, draft_rtt)
        if k and self.chooser:
            self.chooser.observe(k, accepted)
        self.draft_in_step = k > 0

    def commit(self, emitted: list[int]) -> str | None:
        """Append emitted tokens, cut at EOS or the token budget; returns a finish reason or None."""
        budget = self.request.max_new_tokens - self.generated
        eos_at = next((i for i, token in enumerate(emitted) if token in self.eos_ids), None)
        if eos_at is not None and eos_at < budget:
            emitted[:] = emitted[: eos_at + 1]
            self.committed += emitted
            return "stop"
        emitted[:] = emitted[:budget]
        self.committed += emitted
        return "length" if self.generated >= self.request.max_new_tokens else None

    async def release(self) -> None:
        # Best effort: idle eviction frees whatever a dead service could not release.
        await asyncio.gather(self.draft.release(), self.target.release(), return_exceptions=True)


async def served(call) -> tuple:
    """Await a model-service call; returns (reply, seconds the service says it spent, or None)."""
    reply = await call
    held = dict(await call.trailing_metadata() or ())
    seconds = held.get(SERVICE_SECONDS_KEY)
    return reply, None if seconds is None else float(seconds)
