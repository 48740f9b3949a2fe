"""Seeds, several choices and log-probabilities, over gRPC and the OpenAI HTTP API (tiny models).

An unseeded sampled request draws a fresh seed and reports it (Final.seed, each choice's `seed`);
that seed, sent back, reproduces the output exactly. `n` choices and lists of prompts run as
concurrent requests in OpenAI's index order. Log-probabilities are the target's own raw ones: they
equal transformers' log_softmax of the tiny target at each position, with speculation on or off.
"""

import json

import grpc
import pytest
import torch
from test_openai_api import http
from test_orchestrator import generate
from transformers import AutoModelForCausalLM

from specd.v1 import common_pb2, specdecode_pb2

PROMPT = "def quicksort(arr):"
OTHER = "The capital of France is"


def grpc_request(prompt=PROMPT, max_new_tokens=8, k=4, seed=None, logprobs=False, top=0, **sampling):
    message = specdecode_pb2.GenerateRequest(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        draft_tokens=k,
        logprobs=logprobs,
        top_logprobs=top,
        sampling=common_pb2.SamplingParams(**sampling),
    )
    if seed is not None:
        message.sampling.seed = seed
    return message


async def post(base: str, path: str, **body) -> dict:
    status, text = await http("POST", f"{base}/v1/{path}", {"max_tokens": 8, "ignore_eos": True, **body})
    assert status == 200, text
    return json.loads(text)


async def sse(base: str, path: str, **body) -> list[dict]:
    status, text = await http(
        "POST", f"{base}/v1/{path}", {"max_tokens": 8, "ignore_eos": True, "stream": True, **body}
    )
    assert status == 200, text
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.fixture(scope="module")
def target_logprobs(tiny_dirs):
    """log_softmax of the tiny target's logits for a whole sequence, computed by transformers directly."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"], torch_dtype=torch.float32).eval()

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return logprobs


# -- seeds -------------------------------------------------------------------------------------


# A seed reproduces a sample given the same guesses: the accept coins and the residual draws are keyed
# by seed and position (docs/architecture.md §3 rule 4), but which draws are made depends on the K of
# each step and the draft's guesses. So the HTTP test fixes K and the drafter (the adaptive K follows
# measured times), and each test first sends its prompt once, so that every request it compares
# restores the prompt from the prefix cache alike (on the transformers engine a restored prompt and a
# fresh prefill are not bit for bit the same, issue 49 item 6).


async def test_unseeded_grpc_requests_differ_and_the_reported_seed_reproduces_each(tiny_stack):
    await generate(tiny_stack.client, grpc_request(temperature=1.0, seed=1))  # the prompt cached
    first = await generate(tiny_stack.client, grpc_request(temperature=1.0))
    second = await generate(tiny_stack.client, grpc_request(temperature=1.0))
    assert first[2].seed != second[2].seed
    assert first[0] != second[0]  # was: seed 0 for both, the same sample
    for tokens, _, final in (first, second):
        again = await generate(tiny_stack.client, grpc_request(temperature=1.0, seed=final.seed))
        assert again[0] == tokens and again[2].seed == final.seed
    given = await generate(tiny_stack.client, grpc_request(temperature=1.0, seed=12345))
    assert given[2].seed == 12345
    assert (await generate(tiny_stack.client, grpc_request(temperature=1.0, seed=12345)))[0] == given[0]


async def test_unseeded_http_requests_differ_and_the_reported_seed_reproduces_each(tiny_http):
    base, _ = tiny_http
    fixed = {"draft_tokens": 3, "drafter": "model"}  # the same guesses for the same seed
    await post(base, "completions", prompt=PROMPT, temperature=1.0, seed=1, specd=fixed)  # the prompt cached
    answers = [await post(base, "completions", prompt=PROMPT, temperature=1.0, specd=fixed) for _ in range(2)]
    seeds = [answer["choices"][0]["seed"] for answer in answers]
    texts = [answer["choices"][0]["text"] for answer in answers]
    assert seeds[0] != seeds[1] and texts[0] != texts[1]
    for seed, text in zip(seeds, texts):
        again = await post(base, "completions", prompt=PROMPT, temperature=1.0, seed=seed, specd=fixed)
        assert again["choices"][0]["text"] == text and again["choices"][0]["seed"] == seed
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": 3}
    assert (await post(base, "chat/completions", **chat))["choices"] == (await post(base, "chat/completions", **chat))[
        "choices"
    ]


# -- several choices ---------------------------------------------------------------------------


async def test_n_choices_differ_and_each_equals_a_single_request_with_its_seed(tiny_http):
    base, _ = tiny_http
    for seed in (None, 100):
        body = {"prompt": PROMPT, "temperature": 1.0, "n": 3, **({} if seed is None else {"seed": seed})}
        answer = await post(base, "completions", **body)
        choices = answer["choices"]
        assert [choice["index"] for choice in choices] == [0, 1, 2]
        assert len({choice["text"] for choice in choices}) == 3 and len({choice["seed"] for choice in choices}) == 3
        if seed is not None:
            assert [choice["seed"] for choice in choices] == [100, 101, 102]  # seed + j
        assert "specd" not in answer and all(choice["specd"]["steps"] >= 1 for choice in choices)
        assert answer["usage"]["completion_tokens"] == 3 * 8
        for choice in choices:
            single = await post(base, "completions", prompt=PROMPT, temperature=1.0, seed=choice["seed"])
            assert single["choices"][0]["text"] == choice["text"]
            assert answer["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]  # the prompt counts once


async def test_two_prompts_times_two_choices_come_in_openai_order(tiny_stack, tiny_http):
    stack, (base, _) = tiny_stack, tiny_http
    ids = stack.orchestrator.core.tokenizer.encode(OTHER, add_special_tokens=False).ids
    answer = await post(base, "completions", prompt=[PROMPT, ids], n=2, temperature=0)
    choices = answer["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2, 3]
    single = await post(base, "completions", prompt=PROMPT, temperature=0)
    first = single["choices"][0]["text"]
    second = await post(base, "completions", prompt=OTHER, temperature=0)
    assert [choice["text"] for choice in choices] == [first, first] + [second["choices"][0]["text"]] * 2
    assert first != second["choices"][0]["text"]
    prompt_tokens = len(stack.orchestrator.core.tokenizer.encode(PROMPT, add_special_tokens=False).ids) + len(ids)
    cached = answer["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert answer["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 32,
        "total_tokens": prompt_tokens + 32,
    }
    # Each prompt counts once, its cached tokens too: at most all but its last (a choice that opened after
    # another's first pass found that head; the shared stack may have seen PROMPT before).
    assert 0 <= cached <= prompt_tokens - 2
    for alone in (single, second):  # sent again, alone: the head its choices left, all but the last token
        assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == alone["usage"]["prompt_tokens"] - 1


async def test_streamed_choices_carry_their_index_and_equal_the_whole_answer(tiny_http):
    base, _ = tiny_http
    body = {"prompt": PROMPT, "temperature": 1.0, "seed": 9, "n": 2}
    whole = await post(base, "completions", **body)
    chunks = await sse(base, "completions", stream_options={"include_usage": True}, **body)
    texts, finished = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished[choice["index"]] = (choice["seed"], chunk["specd"]["steps"])
    assert [texts[0], texts[1]] == [choice["text"] for choice in whole["choices"]]
    assert sorted(finished) == [0, 1] and [finished[0][0], finished[1][0]] == [9, 10]
    assert chunks[-1]["usage"] == whole["usage"]
    chat = await sse(base, "chat/completions", messages=[{"role": "user", "content": "hi"}], n=2, temperature=0)
    roles = [chunk["choices"][0]["index"] for chunk in chat if chunk["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]


# -- log-probabilities -------------------------------------------------------------------------


async def test_greedy_logprobs_are_the_targets_own_with_speculation_on_and_off(tiny_stack, target_logprobs):
    prompt_ids = tiny_stack.orchestrator.core.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    runs = {}
    for k in (0, 4):
        tokens, logprobs, top = [], [], []
        async for reply in tiny_stack.client.Generate(grpc_request(k=k, max_new_tokens=10, logprobs=True, top=3)):
            if reply.HasField("delta"):
                tokens += reply.delta.token_ids
                logprobs += reply.delta.logprobs
                top += [(list(row.token_ids), list(row.logprobs)) for row in reply.delta.top_logprobs]
        runs[k] = tokens, logprobs, top
    tokens, logprobs, top = runs[0]
    assert runs[4][0] == tokens and len(logprobs) == len(top) == len(tokens) == 10
    assert runs[4][1] == pytest.approx(logprobs, abs=1e-4)  # one Verify pass scores them as decode steps do
    rows = target_logprobs(prompt_ids + tokens)[len(prompt_ids) - 1 : -1]
    direct = rows[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert logprobs == pytest.approx(direct.tolist(), abs=1e-4)
    for token, (ids, values), row in zip(tokens, top, rows):
        assert ids[0] == token and len(ids) == 3  # greedy: the emitted token is the most likely
        assert values == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(tiny_stack.client, grpc_request(logprobs=True, top=21))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in refused.value.details()


async def test_http_logprobs_and_echo(tiny_stack, tiny_http, target_logprobs):
    stack, (base, _) = tiny_stack, tiny_http
    tokenizer = stack.orchestrator.core.tokenizer
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    plain = (await post(base, "completions", prompt=PROMPT, temperature=0, logprobs=2))["choices"][0]
    lp = plain["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(8)]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert next(iter(top)) == token and top[token] == pytest.approx(logprob) and len(top) <= 3

    echoed = (await post(base, "completions", prompt=PROMPT, temperature=0, logprobs=1, echo=True))["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    elp = echoed["logprobs"]
    assert elp["token_logprobs"][0] is None and elp["top_logprobs"][0] is None
    assert len(elp["tokens"]) == len(prompt_ids) + 8 and elp["tokens"][len(prompt_ids) :] == lp["tokens"]
    assert elp["token_logprobs"][len(prompt_ids) :] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    rows = target_logprobs(prompt_ids)
    direct = [rows[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))]
    assert elp["token_logprobs"][1 : len(prompt_ids)] == pytest.approx(direct, abs=1e-4)
    assert (await post(base, "completions", prompt=PROMPT, temperature=0, echo=True))["choices"][0]["logprobs"] is None
    chunks = await sse(base, "completions", prompt=PROMPT, temperature=0, echo=True)
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == echoed["text"]


async def test_chat_logprobs_streamed_or_not(tiny_http):
    base, _ = tiny_http
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = (await post(base, "chat/completions", **body))["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) == 8
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    streamed = []
    for chunk in await sse(base, "chat/completions", **body):
        choice = chunk["choices"][0]
        streamed += (choice["logprobs"] or {}).get("content", [])
    assert [entry["token"] for entry in streamed] == [entry["token"] for entry in content]
    assert [entry["logprob"] for entry in streamed] == pytest.approx([entry["logprob"] for entry in content], abs=1e-4)
    no_top = (await post(base, "chat/completions", **{**body, "top_logprobs": None}))["choices"][0]
    assert all(entry["top_logprobs"] == [] for entry in no_top["logprobs"]["content"])
