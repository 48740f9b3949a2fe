"""What the orchestrator does for a request, whatever the transport: both APIs go through here.

The gRPC servicer (grpc_api.py) and the OpenAI-compatible HTTP API (openai_api.py) only translate:
their request into a specd.v1 GenerateRequest, and the events and stats back. This module owns
the rest, once: the served pair's facts, validating and tokenizing a request (docs/architecture.md
§5), running it on the worker pool with its metrics, and the one serialisation of a request's
speculation stats. So both APIs check, limit and answer alike (greedy output over HTTP equals
greedy output over gRPC).
"""

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from tokenizers import Tokenizer

from specd.orchestrator.adaptive import DEFAULT_MAX_DRAFT_TOKENS
from specd.orchestrator.ahead import DEFAULT_DRAFT_AHEAD, DRAFT_AHEAD_MODES
from specd.orchestrator.drain import Drain
from specd.orchestrator.lookup import DEFAULT_DRAFTER, DRAFTERS, LOOKUP_ONLY
from specd.orchestrator.metrics import OrchestratorMetrics
from specd.orchestrator.remote import ServicePair
from specd.orchestrator.request import Failed, GenerationRequest, Stats
from specd.proto.limits import MAX_CACHE_SALT_CHARS, penalty_problem, q_draft_tokens
from specd.v1 import common_pb2, specdecode_pb2

INFO_TIMEOUT_S = 2.0  # a service's Info is answered on its event loop, never behind a model pass

MAX_TOP_LOGPROBS = 20  # as OpenAI bounds top_logprobs (and the target service: verifier.py)
MAX_PROMPT_LOGPROBS_TOKENS = 1024  # the target scores a prompt's tokens up to this long (verifier.py)
SEED_BITS = 63  # a drawn seed fits a signed 64-bit integer too (JSON clients, numpy)

# SpeculationStats fields that grow with the output (per step): the HTTP API sends them only on `trace`.
STEP_FIELDS = ("step_draft_seconds", "step_verify_seconds")


class BadRequest(Exception):
    """INVALID_ARGUMENT (HTTP 400), with a message the client can act on and, where known, the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Pool(Protocol):
    """What the core runs requests on (worker.py WorkerPool; a Protocol, so the core and the transports
    over it import no Ray): its worker actors, and each request's events."""

    actors: list

    def generate(self, request: GenerationRequest) -> AsyncIterator: ...


@dataclass
class Core:
    pair: ServicePair  # the connected draft (if any) and target, their Info and the target's tokenizer
    pool: Pool
    default_draft_tokens: int | None = None  # K when a request leaves it unset; None: adaptive
    metrics: OrchestratorMetrics | None = None
    max_prompt_tokens: int | None = None  # longest prompt accepted; None = what a session holds
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS  # the largest adaptive K (and no more than the services take)
    drafter: str = DEFAULT_DRAFTER  # for a request that leaves it empty (lookup.py DRAFTERS)
    draft_ahead: str = DEFAULT_DRAFT_AHEAD  # for a request that leaves it empty (ahead.py DRAFT_AHEAD_MODES)
    drain: Drain = field(default_factory=Drain)  # the requests in flight; refuses new ones while draining (drain.py)

    def __post_init__(self):
        self.metrics = self.metrics or OrchestratorMetrics()
        self.max_draft_tokens = min(self.max_draft_tokens, self.services_max_k)

    # -- the served pair ---------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The target's name as its service reports it (ModelInfo.model)."""
        return self.pair.target_info.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.pair.tokenizer

    @property
    def tokenizer_config(self) -> dict:
        """The target's tokenizer_config.json, with its chat template."""
        return self.pair.tokenizer_config

    @property
    def room(self) -> int:
        """The longest session every service takes (prompt + output)."""
        return min(info.max_session_tokens for info in self.pair.infos)

    @property
    def services_max_k(self) -> int:
        return min(info.max_draft_tokens for info in self.pair.infos)

    def q_max_k(self, sampling: common_pb2.SamplingParams) -> int | None:
        """The largest K whose q rows at this sampling fit the draft's --max-q-bytes (ModelInfo.max_q_bytes);
        None where nothing bounds it: greedy (no q rows), no draft (a lookup's rows are one-hot, a few
        bytes each), or a draft that reports no limit."""
        draft = self.pair.draft_info
        if sampling.temperature == 0 or draft is None or not draft.max_q_bytes:
            return None
        return q_draft_tokens(draft.max_q_bytes, sampling.top_k, draft.vocab_size)

    async def info(self) -> specdecode_pb2.OrchestratorInfo:
        """The services' Info as they answer now (sessions, cached tokens, queued calls, passes by
        batch size); for a service that does not answer in time, what it said when we connected.
        Without a draft service, `draft` is left unset."""
        draft, target = await asyncio.gather(
            _live_info(self.pair.draft_stub, self.pair.draft_info),
            _live_info(self.pair.target_stub, self.pair.target_info),
        )
        return specdecode_pb2.OrchestratorInfo(
            draft=draft,
            target=target,
            default_draft_tokens=self.default_draft_tokens or 0,
            workers=len(self.pool.actors),
            adaptive_draft_tokens=self.default_draft_tokens is None,
            max_draft_tokens=self.max_draft_tokens,
            drafter=self.drafter,
            draft_ahead=self.draft_ahead,
        )

    # -- requests ------------------------------------------------------------------------------

    def start(self, message: specdecode_pb2.GenerateRequest, api: str, time_remaining: float | None = None):
        """Check and tokenize `message`, then run it: Delta events, then Finished or Failed.

        Raises BadRequest (counted as refused under `api`) before anything runs. While the server
        drains, the events are one Failed(UNAVAILABLE).
        """
        if refusal := self.drain.refusal():
            self.metrics.rejected(api, "UNAVAILABLE")
            return _refused(refusal)
        try:
            request = self.prepare(message, time_remaining)
        except BadRequest:
            self.metrics.rejected(api)
            raise
        return self.metrics.track(api, self.drain.track(self.pool.generate(request)))

    def rejected(self, api: str, outcome: str = "INVALID_ARGUMENT") -> None:
        """A request an API refused before it reached start() (it could not even be parsed)."""
        self.metrics.rejected(api, outcome)

    def prepare(self, message: specdecode_pb2.GenerateRequest, time_remaining: float | None) -> GenerationRequest:
        """Check the request against docs/architecture.md §5 and the served pair; tokenize the prompt."""
        prompt_ids = list(message.prompt_token_ids)
        if message.prompt:
            prompt_ids = self.tokenizer.encode(message.prompt, add_special_tokens=False).ids
        if not prompt_ids:
            raise BadRequest("the prompt is empty: send `prompt` text or `prompt_token_ids`")
        vocab_size = self.pair.target_info.vocab_size
        if max(prompt_ids) >= vocab_size:
            raise BadRequest(f"prompt token id {max(prompt_ids)} is outside the vocabulary of {vocab_size}")
        if self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens:
            raise BadRequest(
                f"the prompt has {len(prompt_ids)} tokens, this server accepts at most "
                f"{self.max_prompt_tokens} (--max-prompt-tokens); shorten it"
            )
        if message.max_new_tokens < 1:
            raise BadRequest("max_new_tokens must be at least 1")
        if len(prompt_ids) + message.max_new_tokens > self.room:
            raise BadRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({message.max_new_tokens}) exceeds the "
                f"{self.room} tokens a session may hold; shorten the prompt or ask for fewer tokens"
            )
        sampling = message.sampling
        if not sampling.temperature >= 0 or sampling.temperature == float("inf"):
            raise BadRequest(f"temperature must be a finite number >= 0, got {sampling.temperature}", "temperature")
        if not 0 <= sampling.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1] (0 means 1), got {sampling.top_p}", "top_p")
        logit_bias = dict(sampling.logit_bias)
        penalties = (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty or 1.0)
        problem = penalty_problem(*penalties, logit_bias, vocab_size)
        if problem:
            raise BadRequest(problem[1], param=problem[0])
        if message.top_logprobs > MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {message.top_logprobs}")
        if message.prompt_logprobs and len(prompt_ids) > MAX_PROMPT_LOGPROBS_TOKENS:
            raise BadRequest(
                f"prompt_logprobs takes prompts of at most {MAX_PROMPT_LOGPROBS_TOKENS} tokens, got {len(prompt_ids)}"
            )
        k = message.draft_tokens if message.HasField("draft_tokens") else self.default_draft_tokens
        if k is not None and k > self.services_max_k:
            raise BadRequest(
                f"draft_tokens K={k} is above the largest the services accept ({self.services_max_k}); "
                f"0 turns speculation off"
            )
        drafter = message.drafter or self.drafter
        if drafter not in DRAFTERS:
            raise BadRequest(f"drafter {message.drafter!r} is not one of {', '.join(DRAFTERS)}")
        if not self.pair.has_draft and drafter not in LOOKUP_ONLY:
            raise BadRequest(
                f"drafter {drafter!r} guesses with the draft model, and this server runs without a draft "
                f"service: ask for {' or '.join(LOOKUP_ONLY)} (lookups over the text, no draft model)"
            )
        if len(message.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise BadRequest(
                f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(message.cache_salt)}",
                "cache_salt",
            )
        draft_ahead = message.draft_ahead or self.draft_ahead
        if draft_ahead not in DRAFT_AHEAD_MODES:
            raise BadRequest(f"draft_ahead {message.draft_ahead!r} is not one of {', '.join(DRAFT_AHEAD_MODES)}")
        max_k, q_max_k = self.max_draft_tokens, self.q_max_k(sampling)
        draft = self.pair.draft_info
        propose_limit = min(draft.max_draft_tokens, q_max_k or draft.max_draft_tokens) if draft else 0
        if q_max_k is not None:  # sampling with a large top_k (or none): a smaller K, never a refused Propose
            k, max_k = None if k is None else min(k, q_max_k), min(max_k, q_max_k)
        return GenerationRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=message.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p or 1.0,
            top_k=sampling.top_k,
            seed=sampling.seed if sampling.HasField("seed") else secrets.randbits(SEED_BITS),  # unseeded: random
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            logit_bias=logit_bias,
            stop=list(message.stop),
            draft_tokens=k,
            max_draft_tokens=max_k,
            ignore_eos=message.ignore_eos,
            drafter=drafter,
            deadline=None if time_remaining is None else time.time() + time_remaining,
            logprobs=message.logprobs,
            top_logprobs=message.top_logprobs if message.logprobs else 0,
            prompt_logprobs=message.logprobs and message.prompt_logprobs,
            draft_ahead=draft_ahead,
            max_propose_tokens=propose_limit,
            cache_salt=message.cache_salt,
        )


# -- the one stats serialisation ---------------------------------------------------------------


def stats_dict(stats: Stats, steps: bool = True) -> dict:
    """A request's speculation stats named as SpeculationStats' fields (specdecode.proto), for both
    APIs; `steps=False` leaves out the per-step lists (STEP_FIELDS)."""
    answer = {
        "draft_tokens": stats.draft_tokens,
        "adaptive": stats.adaptive,
        "steps": stats.steps,
        "drafting_steps": stats.drafting_steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "accepted_per_position": list(stats.accepted_per_position),
        "draft_lengths": list(stats.draft_lengths),
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
        "network_seconds": stats.network_seconds,
        "other_seconds": stats.other_seconds,
        "tokens_per_s": stats.tokens_per_s,
        "time_to_first_token_s": stats.time_to_first_token_s,
        "resyncs": stats.resyncs,
        "drafter": stats.drafter,
        "target": stats.target,
        "draft": stats.draft,
        "migrations": stats.migrations,
        "draft_moves": stats.draft_moves,
        "lookup_steps": stats.lookup_steps,
        "lookup_drafted": stats.lookup_drafted,
        "lookup_accepted": stats.lookup_accepted,
        "ahead_steps": stats.ahead_steps,
        "ahead_ready": stats.ahead_ready,
        "ahead_late": stats.ahead_late,
        "ahead_wasted_tokens": stats.ahead_wasted_tokens,
        "ahead_hidden_seconds": stats.ahead_hidden_seconds,
    }
    if steps:
        answer["step_draft_seconds"] = [draft for draft, _, _ in stats.step_seconds]
        answer["step_verify_seconds"] = [verify for _, verify, _ in stats.step_seconds]
    return answer


def stats_proto(stats: Stats) -> specdecode_pb2.SpeculationStats:
    return specdecode_pb2.SpeculationStats(**stats_dict(stats))


async def _refused(message: str):
    yield Failed("UNAVAILABLE", message)


async def _live_info(stub, known: common_pb2.ModelInfo | None) -> common_pb2.ModelInfo | None:
    """The service's Info now; what it said at connect time if it does not answer (None: no such service)."""
    if stub is None:
        return known
    try:
        return await stub.Info(common_pb2.InfoRequest(), timeout=INFO_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return known
