"""Draft-ahead (orchestrator/ahead.py): while the target verifies a step, the draft guesses the next.

Real tiny services over gRPC on port 0, a Generation driving them. The output with draft-ahead must
be the target's own, token for token, whatever happens to the guesses drafted ahead: used (a draft
identical to the target accepts everything), wrong (a draft of other weights), late (the draft
slowed by an interceptor, so the verdict comes first), or lost (the draft server stopped while it
drafts ahead). Then the decision rule on synthetic numbers, and the request field at the boundary.
"""

import asyncio
import shutil

import grpc
import pytest
import torch
from conftest import TINY_CONFIG, Services
from test_core import core, request
from transformers import Qwen2Config, Qwen2ForCausalLM

from specd.draft_service.drafter import Drafter
from specd.draft_service.server import create_draft_server
from specd.model.loading import load_model
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.adaptive import ServiceCosts, draft_ahead_gain
from specd.orchestrator.core import BadRequest, stats_dict
from specd.orchestrator.faults import FaultPolicy
from specd.orchestrator.generation import Generation, GenerationRequest
from specd.proto.auth import ServerSecurity
from specd.proto.limits import Limits
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier

PROMPT = [785, 6722, 315, 9625, 374, 12095, 13, 576, 6722, 315]  # ids of the real Qwen2.5 tokenizer
NEW_TOKENS = 24
K = 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
POLICY = FaultPolicy(propose_timeout_s=2.0, call_timeout_s=20.0, target_retry_s=2.0, draft_backoff_s=(0.2, 1.0))


class SlowPropose(grpc.aio.ServerInterceptor):
    """Delays every Propose by `delay` seconds; `ahead` is set when a Propose of K + 1 tokens (one
    drafting ahead: the bonus guess, then K) arrives."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.ahead = asyncio.Event()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.endswith("/Propose"):
            return handler
        behavior = handler.unary_unary

        async def slowed(message, context):
            if message.num_draft_tokens == K + 1:
                self.ahead.set()
            await asyncio.sleep(self.delay)
            return await behavior(message, context)

        return grpc.unary_unary_rpc_method_handler(slowed, handler.request_deserializer, handler.response_serializer)


class Instrumented(ServerSecurity):
    """No auth, plus an interceptor."""

    def __init__(self, interceptor):
        super().__init__()
        object.__setattr__(self, "interceptor", interceptor)

    def interceptors(self):
        return [self.interceptor, *super().interceptors()]


async def serve(draft_loaded, target_loaded, slow: SlowPropose | None = None) -> Services:
    limits = Limits(max_sessions=8)
    draft = create_draft_server(lambda: Drafter(TransformersEngine(draft_loaded), limits))
    target = create_target_server(lambda: Verifier(TransformersEngine(target_loaded), limits))
    await draft.start("127.0.0.1:0", Instrumented(slow) if slow else ServerSecurity())
    await target.start("127.0.0.1:0")
    await asyncio.gather(draft.load(), target.load())
    return Services(draft, target)


class Tokenless:
    """Enough of a tokenizers.Tokenizer for OutputText: every token is one character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + token % 26) for token in ids)


async def generate(services: Services, k: int | None, ahead: str, **sampling):
    """The request's output tokens and Stats (the draft model guesses every step: no prompt lookup)."""
    request = GenerationRequest(list(PROMPT), NEW_TOKENS, draft_tokens=k, ignore_eos=True, drafter="model", **sampling)
    request.draft_ahead, request.max_propose_tokens = ahead, Limits().max_draft_tokens  # as core.py sets them
    generation = Generation(request, services.draft, services.target, Tokenless(), set(), POLICY)
    tokens, finished = [], None
    async for event in generation.run():
        tokens += getattr(event, "token_ids", [])
        finished = event
    assert finished.reason == "length" and len(tokens) == NEW_TOKENS
    return tokens, finished.stats


@pytest.fixture(scope="module")
def other_draft(tiny_dirs, tmp_path_factory):
    """A tiny draft of other weights and an untied output layer: its guesses are (almost) never the
    target's (tied tiny models tend to agree: each repeats its input token)."""
    folder = tmp_path_factory.mktemp("other")
    torch.manual_seed(3)
    Qwen2ForCausalLM(Qwen2Config(**dict(TINY_CONFIG, tie_word_embeddings=False))).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_dirs["target"] / name, folder / name)
    return load_model(str(folder), "float32")


async def test_guesses_drafted_ahead_are_used_and_greedy_output_stays_the_targets(tiny_loaded):
    """A draft identical to the target accepts everything: every step after the first speculative
    one takes the guesses drafted during the last verify."""
    services = await serve(tiny_loaded["target"], tiny_loaded["target"])
    try:
        target_only, _ = await generate(services, 0, "off")
        synchronous, off = await generate(services, K, "off")
        ahead, stats = await generate(services, K, "on")
        adaptive, _ = await generate(services, None, "on")
    finally:
        await services.close()
    assert synchronous == target_only and ahead == target_only and adaptive == target_only
    assert off.ahead_steps == 0 and off.ahead_ready == 0
    assert 1 <= stats.ahead_ready <= stats.ahead_steps  # a slow moment may make one too late to wait for
    assert stats.ahead_hidden_seconds > 0 and stats.accepted == stats.drafted  # all accepted
    said = stats_dict(stats)
    assert said["ahead_ready"] == stats.ahead_ready and said["ahead_wasted_tokens"] == stats.ahead_wasted_tokens


async def test_wrong_guesses_drafted_ahead_are_discarded_and_greedy_output_stays_the_targets(tiny_loaded, other_draft):
    services = await serve(other_draft, tiny_loaded["target"])
    try:
        target_only, _ = await generate(services, 0, "off")
        ahead, stats = await generate(services, K, "on")
    finally:
        await services.close()
    assert ahead == target_only
    assert stats.ahead_steps > 0 and stats.ahead_ready < stats.ahead_steps
    assert stats.ahead_wasted_tokens >= 2 * stats.ahead_steps  # each discarded: its bonus guess and >= 1 more


async def test_guesses_drafted_ahead_that_come_after_the_verdict_are_waited_for(tiny_loaded):
    """Every Propose takes 80 ms more, a tiny verify a few: the verdict comes first, and the step
    waits for the pre-draft (it asked sooner than a fresh Propose would)."""
    services = await serve(tiny_loaded["target"], tiny_loaded["target"], SlowPropose(delay=0.08))
    try:
        target_only, _ = await generate(services, 0, "off")
        ahead, stats = await generate(services, K, "on")
    finally:
        await services.close()
    assert ahead == target_only
    assert stats.ahead_late >= 1 and stats.ahead_ready >= 1


async def test_a_draft_that_dies_while_drafting_ahead_costs_no_token(tiny_loaded):
    """The draft server stops while a call drafting ahead is in flight: the step goes on, the next
    ones run target-only (the gate is closed), and the output is the target's."""
    slow = SlowPropose(delay=0.3)
    services = await serve(tiny_loaded["target"], tiny_loaded["target"], slow)
    try:
        target_only, _ = await generate(services, 0, "off")

        async def kill_the_draft_while_it_drafts_ahead():
            await slow.ahead.wait()
            await services.draft_server.stop(0)

        killer = asyncio.ensure_future(kill_the_draft_while_it_drafts_ahead())
        ahead, stats = await asyncio.wait_for(generate(services, K, "on"), timeout=60)
        await killer
    finally:
        await services.close()
    assert ahead == target_only
    assert stats.ahead_steps >= 1 and stats.ahead_ready == 0
    assert 0 in stats.draft_lengths[2:]  # target-only steps after the draft died


async def test_seeded_sampling_gives_the_same_tokens_with_and_without_draft_ahead(tiny_loaded):
    """Each draw depends only on (seed, position, stream) (§3 rule 4), and a pre-draft is used only
    where its context is the committed one: so the same tokens either way (within numerics: the
    pre-draft reads its bonus guess in a pass of its own)."""
    services = await serve(tiny_loaded["target"], tiny_loaded["target"])
    sampling = dict(temperature=0.05, top_k=50, seed=11)  # peaked: the bonus guess is often right
    try:
        synchronous, _ = await generate(services, K, "off", **sampling)
        ahead, stats = await generate(services, K, "on", **sampling)
    finally:
        await services.close()
    assert ahead == synchronous and stats.ahead_ready >= 1


# -- the decision rule on synthetic numbers (adaptive.py draft_ahead_gain) --------------------------

REMOTE = dict(t_draft=0.03, t_verify=0.1, rtt_draft=0.02, rtt_target=0.02)  # seconds


def test_drafting_ahead_pays_for_a_remote_draft_that_is_usually_right():
    gain = draft_ahead_gain(0.8, 0.8, 4, 4, **REMOTE)
    assert gain > 0.02  # about 27 % of the time it saves 4 guesses and a round trip (140 ms)


def test_drafting_ahead_does_not_pay_on_the_targets_own_cores():
    shared = dict(REMOTE, rtt_draft=0.0, rtt_target=0.0)
    assert draft_ahead_gain(0.8, 0.8, 4, 4, **shared, shared=1.0) < 0
    assert draft_ahead_gain(0.8, 0.8, 4, 4, **shared, shared=0.0) > 0  # the same numbers on cores of its own


def test_drafting_ahead_does_not_pay_when_guesses_are_rarely_all_accepted_or_come_too_late():
    assert draft_ahead_gain(0.2, 0.2, 4, 4, **REMOTE) < 0.001  # α^K·β = 0.03%
    slow = dict(REMOTE, t_draft=0.5)  # the pre-draft comes 2.4 s after the verdict
    assert draft_ahead_gain(0.8, 0.8, 4, 4, **slow) < 0


def test_the_chooser_prices_drafting_ahead_from_measured_costs_and_contention():
    costs = ServiceCosts()
    assert not costs.draft_ahead_pays(0.9, 4, 4)  # nothing measured yet
    costs.record_verify(0, 0.08, 0.02)
    costs.record_verify(4, 0.1, 0.02)
    costs.record_draft(4, 0.12, 0.02)
    assert costs.draft_ahead_pays(0.9, 4, 4)
    assert not costs.draft_ahead_pays(0.3, 4, 4)
    for _ in range(10):  # beside the verify a guess took twice the draft's alone: they share cores
        costs.record_ahead(0.06)
    assert costs.ahead_slowdown.value > 0.9
    assert not costs.draft_ahead_pays(0.9, 4, 4)


def test_a_request_names_a_known_draft_ahead_mode():
    assert core().prepare(request(), None).draft_ahead == "auto"
    assert core(draft_ahead="off").prepare(request(), None).draft_ahead == "off"
    assert core(draft_ahead="off").prepare(request(draft_ahead="on"), None).draft_ahead == "on"
    with pytest.raises(BadRequest, match="draft_ahead 'sometimes' is not one of auto, on, off"):
        core().prepare(request(draft_ahead="sometimes"), None)
