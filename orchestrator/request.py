"""A request's types: what is asked (GenerationRequest), what streams back (Delta events, then one
Finished, or a Failed with its status code), and the speculation stats it keeps on the way (Stats).

Generation (generation.py) fills them; the worker pool carries them over Ray; the gRPC servicer,
the HTTP API and the metrics read them.
"""

from dataclasses import dataclass, field

from specd.orchestrator.ahead import DEFAULT_DRAFT_AHEAD
from specd.orchestrator.lookup import DEFAULT_DRAFTER


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    presence_penalty: float = 0.0  # penalties and biases (common.proto SamplingParams): the services apply them
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0  # 0 = off (1)
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    draft_tokens: int | None = None  # K; 0 = speculation off; None = chosen every step (adaptive.py)
    max_draft_tokens: int = 8  # the largest K an adaptive request may choose
    drafter: str = DEFAULT_DRAFTER  # who guesses: "model", "ngram" (prompt lookup), "suffix" or "hybrid" (lookup.py)
    ignore_eos: bool = False
    deadline: float | None = None  # time.time() by which the request must end
    session_id: str = ""  # the services' session id (the pool sets it, to release it if a worker dies)
    logprobs: bool = False  # return the target's log p of each output token (its raw logits, target.proto)
    top_logprobs: int = 0  # with logprobs: the N most likely tokens at each output position too
    prompt_logprobs: bool = False  # with logprobs: those of the prompt's tokens after its first too (first Delta)
    draft_ahead: str = DEFAULT_DRAFT_AHEAD  # "on", "off" or "auto": draft the next step during the verify (ahead.py)
    max_propose_tokens: int = 0  # the most guesses one Propose may ask for (the draft's limits); 0: the K bound
    cache_salt: str = ""  # the tenant's: every cursor carries it, so the services reuse only its prefixes
    target: str = ""  # the target replica the pool routed it to (router.py); "": the only one
    draft: str = ""  # the draft replica the pool routed it to; "": the only one, or none asked
    # Output tokens an earlier attempt already streamed (the pool moved the request off a failed target
    # replica, migration.py): this attempt continues after them, and streams only what follows.
    resumed: list[int] = field(default_factory=list)
    # Another target replica can take the request over (the pool's migration): give a failing or frozen
    # target up sooner (faults.py: the failover retry window and the step deadline)
    failover: bool = False
    # Draft replicas to go on with, best first, where the draft replica fails (the pool's router names them)
    spare_drafts: list[str] = field(default_factory=list)


TopLogprobs = list[tuple[list[int], list[float]]]  # per position: the most likely (token ids, log p)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # of token_ids, when the request asked
    top_logprobs: TopLogprobs = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # first Delta only: of prompt tokens 1..
    prompt_top_logprobs: TopLogprobs = field(default_factory=list)


@dataclass
class Finished:
    reason: str  # "length" (max_new_tokens) or "stop" (EOS or a stop string)
    prompt_tokens: int
    completion_tokens: int
    stats: "Stats"
    seed: int = 0  # the seed the request sampled with (its own, or the one drawn for it)
    cached_prompt_tokens: int = 0  # of prompt_tokens, those the target took from its prefix cache


# The retry hint of a request refused for load: the orchestrator's limit or a full service frees a
# place as soon as one request ends, which on a busy stack is within about a second. Both APIs send
# it: gRPC as `grpc-retry-pushback-ms` (gRFC A6 server pushback), HTTP as `Retry-After`.
RETRY_AFTER_S = 1.0


@dataclass
class Failed:
    """A service error that ended the request: the status code name and its details."""

    code: str
    message: str
    service: str = ""  # what failed: a model service ("target" or "draft"), or the pool's "worker" actor

    @property
    def retry_after_s(self) -> float | None:
        """When a retry may find room (RESOURCE_EXHAUSTED: a limit, not a fault); None: no hint."""
        return RETRY_AFTER_S if self.code == "RESOURCE_EXHAUSTED" else None


@dataclass
class Rebound:
    """The request left its failed draft replica for another (`draft`): for the pool's router, never
    the client (the pool keeps it from the stream)."""

    failed: str
    draft: str


@dataclass
class Stats:
    draft_tokens: int = 0  # the fixed K, or the largest K when adaptive
    adaptive: bool = False
    steps: int = 0
    drafting_steps: int = 0  # steps that verified >= 1 draft token (vLLM's num_drafts)
    drafted: int = 0
    accepted: int = 0
    drafter: str = ""
    target: str = ""  # the target replica that served it (its address)
    draft: str = ""  # the draft replica it was routed to (its address); "": none asked, or the only one
    lookup_steps: int = 0  # of drafting_steps, those the prompt lookup guessed for (no draft call)
    lookup_drafted: int = 0
    lookup_accepted: int = 0
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
    migrations: int = 0  # times the pool moved the request off a failed target replica or worker (migration.py)
    draft_moves: int = 0  # times it left a failed draft replica for another (generation.py move_draft)
    ahead_steps: int = 0  # steps that drafted the next step ahead during their verify (ahead.py)
    ahead_ready: int = 0  # steps that took guesses drafted ahead (no Propose to wait for)
    ahead_late: int = 0  # of those, the ones whose guesses came after the verdict (the step waited)
    ahead_wasted_tokens: int = 0  # tokens drafted ahead and never verified (discarded, or the bonus guess)
    ahead_hidden_seconds: float = 0.0  # draft time and round trip the used pre-drafts spent behind a verify

    def record_step(self, drafted: int, accepted: int, lookup: bool = False) -> None:
        self.steps += 1
        if lookup:
            self.lookup_steps += 1
            self.lookup_drafted += drafted
            self.lookup_accepted += accepted
        self.draft_lengths.append(drafted)
        self.drafting_steps += drafted > 0
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(0, grow)
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def record_times(
        self, draft_wall: float, draft_served: float | None, verify_wall: float, verify_served: float | None
    ) -> None:
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
