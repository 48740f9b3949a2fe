"""presence_penalty, frequency_penalty, repetition_penalty and logit_bias (model/sampling.py penalise):
hand-built rows; greedy speculation equal to the target alone with the same penalties and to a plain
loop over the tiny target; sampled speculation following the penalised target's exact distribution
(and a negative control the test rejects); the checks at the HTTP layer, the orchestrator and the
services."""

import asyncio
import copy
import json
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import pytest
import torch
from conftest import SERVICE_ENGINES, TINY_CONFIG
from transformers import Qwen2Config, Qwen2ForCausalLM

from specd.draft_service.drafter import Drafter, ProposeCall
from specd.model.loaded import LoadedModel
from specd.model.sampling import Sampling, penalise, probs_from_logits
from specd.model.sessions import Cursor
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.openai_api import HttpApi
from specd.proto.contract import fingerprint
from specd.proto.limits import Limits
from specd.target_service.verifier import Verifier, VerifyCall
from specd.v1 import common_pb2, draft_pb2, specdecode_pb2, target_pb2

PROMPT = [785, 8251, 7640, 389, 279, 5837, 13, 576, 785, 8251]  # token ids: no tokenizer in between
PENALTIES = dict(presence_penalty=1.0, frequency_penalty=0.8, repetition_penalty=1.3, logit_bias={151: 0.6, 9: -0.4})


def reference_row(logits: torch.Tensor, prompt: list[int], output: list[int], sampling: Sampling) -> torch.Tensor:
    """One [V] row penalised the slow, obvious way, as vLLM defines it: bias, then repetition over the
    prompt and the output, then frequency and presence over the output."""
    row = logits.double().clone()
    for token, bias in sampling.logit_bias.items():
        row[token] += bias
    for token in set(prompt + output):
        value = float(row[token])
        row[token] = value / sampling.repetition_penalty if value > 0 else value * sampling.repetition_penalty
    for token in set(output):
        row[token] -= sampling.presence_penalty + sampling.frequency_penalty * output.count(token)
    return row.float()


# -- the function, on hand-built rows ----------------------------------------------------------


def test_presence_and_frequency_count_the_output_only():
    sampling = Sampling(presence_penalty=0.5, frequency_penalty=0.25, prompt_tokens=3)
    history = [1, 1, 2, 2, 3, 3]  # prompt 1, 1, 2; output 2, 3, 3
    row = penalise(torch.zeros(1, 6), sampling, history)[0]
    assert row.tolist() == [0.0, 0.0, -0.75, -1.0, 0.0, 0.0]  # token 1 is in the prompt only: untouched


def test_repetition_divides_positive_and_multiplies_negative_logits_over_prompt_and_output():
    sampling = Sampling(repetition_penalty=2.0, prompt_tokens=2)
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0]])
    row = penalise(logits, sampling, [0, 1, 2])[0]  # prompt 0, 1; output 2
    assert row.tolist() == [1.0, -4.0, 1.0, -2.0, 2.0]


def test_logit_bias_is_added_before_the_penalties():
    sampling = Sampling(repetition_penalty=2.0, logit_bias={0: 3.0, 4: -100.0})
    row = penalise(torch.tensor([[-1.0, 0.5, 0.0, 0.0, 1.0]]), sampling, [0])[0]
    assert row.tolist() == [1.0, 0.5, 0.0, 0.0, -99.0]  # token 0: (-1 + 3) / 2, penalised after its bias
    assert int(row.argmax()) == 0  # what greedy takes


def test_each_verify_row_counts_the_guesses_before_it():
    """Row j of a K-guess verify sees the history and the first j guesses, whatever repeats."""
    sampling = Sampling(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.5, prompt_tokens=3)
    torch.manual_seed(0)
    logits, history, guesses = torch.randn(4, 12), [5, 6, 7, 7, 8], [8, 8, 3]
    rows = penalise(logits, sampling, history, guesses)
    for j in range(4):
        sequence = history + guesses[:j]
        expected = reference_row(logits[j], sequence[:3], sequence[3:], sampling)
        assert torch.allclose(rows[j], expected, atol=1e-6), j
    assert rows[1, 8] < rows[0, 8] and rows[2, 8] < rows[1, 8]  # token 8 once more before each next row


def test_a_guess_inside_the_prompt_counts_as_prompt():
    """Positions before prompt_tokens are the prompt even when a call's rows reach back there."""
    sampling = Sampling(presence_penalty=1.0, prompt_tokens=3)
    rows = penalise(torch.zeros(3, 4), sampling, [0, 1], [2, 3])  # guess 2 sits at position 2: prompt
    assert rows[1].tolist() == [0.0, 0.0, 0.0, 0.0] and rows[2].tolist() == [0.0, 0.0, 0.0, -1.0]


def test_nothing_set_costs_nothing():
    logits = torch.randn(3, 10)
    assert penalise(logits, Sampling(temperature=0.7, top_k=5), [1, 2, 3], [4, 5]) is logits
    assert not Sampling(repetition_penalty=1.0).penalised and Sampling(logit_bias={1: 0.0}).penalised


# -- the target service: history through the guesses ------------------------------------------


def penalised_greedy(model, prompt: list[int], n: int, sampling: Sampling) -> list[int]:
    """The tiny target's greedy continuation with penalties: a full forward per token, no cache."""
    output = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(reference_row(logits, prompt, output, sampling).argmax()))
    return output


@pytest.mark.parametrize("engine", SERVICE_ENGINES)
def test_greedy_verify_with_penalties_accepts_the_penalised_continuation(tiny_loaded, tiny_engines, engine):
    """Guesses equal to the penalised greedy continuation are all accepted, and the bonus token is
    its next token: each row saw the guesses before it (their repeats penalised). On each engine:
    the penalties work on whatever logits it gives."""
    sampling = Sampling(**PENALTIES, prompt_tokens=len(PROMPT))
    expected = penalised_greedy(tiny_loaded["target"].model, PROMPT, 6, sampling)
    plain = penalised_greedy(tiny_loaded["target"].model, PROMPT, 6, Sampling(prompt_tokens=len(PROMPT)))
    assert expected != plain  # the penalties change this continuation
    verifier = Verifier(tiny_engines(engine)["target"](Limits(max_sessions=4)), Limits(max_sessions=4))
    committed = PROMPT + expected[:1]  # one output token committed, so the output starts before the guesses
    cursor = Cursor("verify", 0, 0, committed)
    verification = verifier.verify(VerifyCall(cursor, expected[1:5], [], sampling))
    assert verification.accepted == 4 and verification.emitted_tokens == expected[1:6]
    unpenalised = verifier.verify(VerifyCall(Cursor("plain", 0, 0, committed), expected[1:5], [], Sampling()))
    assert unpenalised.accepted < 4  # the same guesses without the penalties: the target disagrees


# -- sampled speculation follows the penalised target ------------------------------------------

SEEDS = 800
CHUNK = 200  # sessions per batched call
SMALL_VOCAB = 512


def speculative_pairs(drafter: Drafter, verifier: Verifier, sampling_of, committed: list[int]) -> list[tuple]:
    """For each seed, the next two tokens after `committed` as speculation emits them: propose K=2
    on the draft, verify on the target, commit, until two are out (CHUNK sessions batched a call)."""
    pairs = []
    for first in range(0, SEEDS, CHUNK):
        runs = {seed: list(committed) for seed in range(first, first + CHUNK)}
        draft_holds = {seed: [] for seed in runs}  # the tokens each side caches, as its replies said
        target_holds = {seed: 0 for seed in runs}

        while pending := [seed for seed, tokens in runs.items() if len(tokens) < len(committed) + 2]:
            proposals = drafter.propose_batch(
                [
                    ProposeCall(_cursor(seed, runs[seed], _shared(draft_holds[seed], runs[seed])), 2, sampling_of(seed))
                    for seed in pending
                ]
            )
            calls = [
                VerifyCall(
                    _cursor(seed, runs[seed], target_holds[seed]), proposal.draft_tokens, proposal.q, sampling_of(seed)
                )
                for seed, proposal in zip(pending, proposals)
            ]
            for seed, proposal, verification in zip(pending, proposals, verifier.verify_batch(calls)):
                draft_holds[seed] = (runs[seed] + proposal.draft_tokens)[: proposal.cached_tokens]
                runs[seed] += verification.emitted_tokens
                target_holds[seed] = verification.cached_tokens
        for seed, tokens in runs.items():
            pairs.append(tuple(tokens[len(committed) : len(committed) + 2]))
            drafter.release(f"s{seed}")
            verifier.release(f"s{seed}")
    return pairs


def _cursor(seed: int, tokens: list[int], start: int) -> Cursor:
    start = min(start, len(tokens) - 1)  # every call carries at least the last token
    return Cursor(f"s{seed}", start, fingerprint(tokens[:start]), tokens[start:])


def _shared(held: list[int], committed: list[int]) -> int:
    """The longest prefix the draft's tokens share with the committed ones."""
    length = 0
    while length < min(len(held), len(committed)) and held[length] == committed[length]:
        length += 1
    return length


def exact_pairs(model, prompt: list[int], committed: list[int], sampling: Sampling) -> dict[tuple, float]:
    """P(next two tokens) under the penalised target, from full forwards of the tiny model."""

    def next_probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1]
        row = reference_row(logits, prompt, tokens[len(prompt) :], sampling)
        return probs_from_logits(row, sampling)

    first = next_probs(committed)
    joint = {}
    for x in torch.nonzero(first).flatten().tolist():
        second = next_probs(committed + [x])
        for y in torch.nonzero(second).flatten().tolist():
            joint[(x, y)] = float(first[x] * second[y])
    return joint


def chi_square_p_value(observed: list[tuple], expected: dict[tuple, float]) -> float:
    """Pearson's test of the observed pairs against `expected`; cells expecting fewer than 5 are pooled,
    and a pair outside expected's support lands in the pool (so it counts against the fit)."""
    n = len(observed)
    counts = {cell: 0 for cell in expected}
    outside = 0
    for pair in observed:
        if pair in counts:
            counts[pair] += 1
        else:
            outside += 1
    cells, pool_expected, pool_observed = [], 0.0, outside
    for cell, probability in expected.items():
        if probability * n >= 5:
            cells.append((counts[cell], probability * n))
        else:
            pool_expected, pool_observed = pool_expected + probability * n, pool_observed + counts[cell]
    if pool_observed or pool_expected:
        cells.append((pool_observed, max(pool_expected, 1e-9)))
    statistic = sum((seen - wanted) ** 2 / wanted for seen, wanted in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


@pytest.fixture(scope="module")
def small_pair(tiny_loaded) -> dict[str, LoadedModel]:
    """The tiny architecture over SMALL_VOCAB ids, so that many seeds' sampled rows stay cheap; the
    draft is the target plus noise (it half agrees). The tokenizer is the tiny pair's: only the
    engine's description reads it."""
    torch.manual_seed(3)
    target = Qwen2ForCausalLM(Qwen2Config(**{**TINY_CONFIG, "vocab_size": SMALL_VOCAB})).eval()
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    tokenizer = tiny_loaded["target"].tokenizer
    return {
        role: LoadedModel(f"small-{role}", "", model, tokenizer, torch.float32)
        for role, model in (("draft", draft), ("target", target))
    }


def test_sampled_speculation_with_penalties_follows_the_penalised_target(small_pair):
    """Over many seeds, the two tokens after a committed output token, as draft + target emit them
    (the second one often from a row that counted the first guess), against the penalised target's
    exact joint distribution; unpenalised speculation fails the same test. top_k=3 keeps the support
    small enough to count."""
    limits = Limits(max_sessions=CHUNK)
    drafter = Drafter(TransformersEngine(small_pair["draft"]), limits)
    verifier = Verifier(TransformersEngine(small_pair["target"]), limits)
    model, prompt = small_pair["target"].model, [17, 305, 42, 97, 305, 8, 250, 17]
    plain = Sampling(temperature=1.0, top_k=3, prompt_tokens=len(prompt))
    penalised = Sampling(temperature=1.0, top_k=3, **PENALTIES, prompt_tokens=len(prompt))
    with torch.no_grad():  # the tiny model tends to repeat its last token: the penalties bite
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    committed = prompt + [first]
    expected = exact_pairs(model, prompt, committed, penalised)
    assert abs(sum(expected.values()) - 1) < 1e-5

    def seeded(sampling: Sampling):
        return lambda seed: replace(sampling, seed=seed)

    observed = speculative_pairs(drafter, verifier, seeded(penalised), committed)
    assert chi_square_p_value(observed, expected) > 1e-3
    control = speculative_pairs(drafter, verifier, seeded(plain), committed)
    assert chi_square_p_value(control, expected) < 1e-6  # the test can tell the penalties' absence
    assert chi_square_p_value(control, exact_pairs(model, prompt, committed, plain)) > 1e-3


# -- end to end: orchestrator on Ray, gRPC and HTTP --------------------------------------------


def generate_request(k: int | None, max_new_tokens: int = 16, **sampling) -> specdecode_pb2.GenerateRequest:
    message = specdecode_pb2.GenerateRequest(
        prompt_token_ids=PROMPT,
        max_new_tokens=max_new_tokens,
        sampling=common_pb2.SamplingParams(**sampling),
        ignore_eos=True,
        drafter="model",
    )
    if k is not None:
        message.draft_tokens = k
    return message


async def generated_tokens(client, message) -> tuple[list[int], specdecode_pb2.Final]:
    tokens, final = [], None
    async for reply in client.Generate(message):
        if reply.HasField("delta"):
            tokens += reply.delta.token_ids
        else:
            final = reply.final
    return tokens, final


async def test_greedy_with_penalties_speculative_equals_target_only_and_the_reference(tiny_stack, tiny_loaded):
    expected = penalised_greedy(
        tiny_loaded["target"].model, PROMPT, 16, Sampling(**PENALTIES, prompt_tokens=len(PROMPT))
    )
    off, _ = await generated_tokens(tiny_stack.client, generate_request(0, **PENALTIES))
    assert off == expected  # the orchestrator told the services where the output begins
    for k in (1, 3, 5):
        tokens, final = await generated_tokens(tiny_stack.client, generate_request(k, **PENALTIES))
        assert tokens == expected, k
        assert final.stats.drafted > 0 and final.stats.accepted > 0  # the draft, penalised too, agreed sometimes
    plain, _ = await generated_tokens(tiny_stack.client, generate_request(3))
    assert plain != expected


@pytest.mark.parametrize(
    "sampling, fragment",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=2.5), "repetition_penalty"),
        (dict(logit_bias={999_999: 1.0}), "outside the vocabulary"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={token: 1.0 for token in range(301)}), "at most 300"),
    ],
)
async def test_bad_penalties_over_grpc_are_invalid_argument(tiny_stack, sampling, fragment):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generated_tokens(tiny_stack.client, generate_request(2, max_new_tokens=2, **sampling))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in caught.value.details()


async def test_the_services_refuse_bad_penalties(tiny_stack):
    """Called directly (not through the orchestrator), each service checks them too."""
    services = tiny_stack.services
    cursor = common_pb2.SessionCursor(session_id="bad-penalty", start=0, fingerprint=0, tokens=PROMPT)
    bad = common_pb2.SamplingParams(presence_penalty=9.0)
    for call in (
        services.target.Decode(target_pb2.DecodeRequest(cursor=cursor, sampling=bad)),
        services.draft.Propose(draft_pb2.ProposeRequest(cursor=cursor, num_draft_tokens=2, sampling=bad)),
        services.target.Decode(
            target_pb2.DecodeRequest(cursor=cursor, sampling=common_pb2.SamplingParams(logit_bias={200_000: 1.0}))
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "penalty" in caught.value.details() or "vocabulary" in caught.value.details()


async def http(method: str, url: str, body=None) -> tuple[int, str]:
    """One plain HTTP call (status, body text), off the event loop."""

    def call():
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    return await asyncio.to_thread(call)


@pytest.fixture(scope="module")
async def tiny_http(tiny_stack):
    http_api = HttpApi(tiny_stack.orchestrator.core)
    port = await http_api.start("127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}"
    await http_api.stop()


async def test_http_serves_penalties_and_they_change_the_output(tiny_http, tiny_stack):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, plain = await http("POST", f"{tiny_http}/v1/completions", body)
    assert status == 200, plain
    penalised_body = {**body, **PENALTIES, "logit_bias": {str(k): v for k, v in PENALTIES["logit_bias"].items()}}
    status, penalised = await http("POST", f"{tiny_http}/v1/completions", penalised_body)
    assert status == 200, penalised
    text = json.loads(penalised)["choices"][0]["text"]
    assert text != json.loads(plain)["choices"][0]["text"]
    message = generate_request(None, max_new_tokens=12, **PENALTIES)
    streamed = [reply.delta.text async for reply in tiny_stack.client.Generate(message) if reply.HasField("delta")]
    assert "".join(streamed) == text  # HTTP and gRPC alike


@pytest.mark.parametrize(
    "fields, param, fragment",
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": "a lot"}, "frequency_penalty", "finite number"),
        ({"repetition_penalty": 0}, "repetition_penalty", "(0, 2]"),
        ({"repetition_penalty": 3}, "repetition_penalty", "(0, 2]"),
        ({"logit_bias": [1, 2]}, "logit_bias", "an object"),
        ({"logit_bias": {"hello": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"-5": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": "up"}}, "logit_bias", "a number"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {str(token): 1 for token in range(301)}}, "logit_bias", "at most 300"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "logit_bias token id 999999 is outside the vocabulary"),
    ],
)
async def test_http_bad_penalties_are_400_naming_the_field(tiny_http, fields, param, fragment):
    body = {"prompt": "def f():", "max_tokens": 2, **fields}
    for path in ("completions", "chat/completions"):
        if path.startswith("chat"):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
        status, text = await http("POST", f"{tiny_http}/v1/{path}", body)
        error = json.loads(text)["error"]
        assert status == 400, text
        assert error["param"] == param and fragment in error["message"], error
