"""The OpenAI-compatible HTTP API: the official `openai` client against it, greedy output equal to
the gRPC API's, OpenAI-style 400s for what specd does not do, and the Prometheus counters
consistent with the per-request stats."""

import asyncio
import json
import re
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from specd.orchestrator.core import STEP_FIELDS
from specd.orchestrator.openai_api import HttpApi
from specd.proto.metrics import start_exporter
from specd.v1 import common_pb2, specdecode_pb2

PROMPT = "def quicksort(arr):"
STATS_FIELDS = {field.name for field in specdecode_pb2.SpeculationStats.DESCRIPTOR.fields}
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Write a Python function that reverses a string."},
]


@pytest.fixture(scope="module")
async def tiny_http(tiny_stack):
    """The tiny stack's orchestrator, also serving HTTP on a free port."""
    http = HttpApi(tiny_stack.orchestrator.core)
    port = await http.start("127.0.0.1", 0)
    yield tiny_stack, f"http://127.0.0.1:{port}", http.api.model_name
    await http.stop()


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


async def grpc_generate(
    stack, max_new_tokens: int, k: int | None = None, prompt: str = "", prompt_token_ids=(), ignore_eos: bool = True
) -> tuple[str, specdecode_pb2.Final]:
    message = specdecode_pb2.GenerateRequest(
        prompt=prompt,
        prompt_token_ids=list(prompt_token_ids),
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        sampling=common_pb2.SamplingParams(temperature=0),
    )
    if k is not None:
        message.draft_tokens = k
    text, final = "", None
    async for reply in stack.client.Generate(message):
        if reply.HasField("delta"):
            text += reply.delta.text
        else:
            final = reply.final
    return text, final


async def http(method: str, url: str, body=None, headers=None, context=None) -> tuple[int, str]:
    """One plain HTTP call (status, body text), off the event loop."""

    def call():
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(request, timeout=120, context=context) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    return await asyncio.to_thread(call)


def chat_prompt_ids(model_dir) -> list[int]:
    """What transformers itself renders for CHAT: our Jinja rendering must give the same ids."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))


async def test_openai_completion_equals_grpc_greedy(tiny_http):
    stack, base, model = tiny_http
    expected, final = await grpc_generate(stack, 16, prompt=PROMPT)
    completion = await client(base).completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = completion.choices[0]
    assert choice.text == expected and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 16 and completion.usage.prompt_tokens == final.usage.prompt_tokens
    stats = completion.model_extra["specd"]
    assert set(stats) == STATS_FIELDS - set(STEP_FIELDS)  # the gRPC Final's names; per-step lists on `trace` only
    # adaptive K, up to 8 (whether it drafts is the chooser's call: the shared stack's worker may have
    # learned that speculation does not pay between the tiny models, and its probe budget may be spent)
    assert stats["draft_tokens"] == 8 and stats["adaptive"]
    assert stats["accepted"] == sum(stats["accepted_per_position"]) and 0 <= stats["acceptance_rate"] <= 1
    fixed = await client(base).completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "specd": {"draft_tokens": 3, "drafter": "model"}},
    )
    stats = fixed.model_extra["specd"]
    assert fixed.choices[0].text == expected and stats["draft_tokens"] == 3 and not stats["adaptive"]
    assert stats["drafted"] > 0 and stats["accepted"] == sum(stats["accepted_per_position"])
    ahead = await client(base).completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "specd": {"draft_tokens": 3, "drafter": "model", "draft_ahead": "on"}},
    )
    stats = ahead.model_extra["specd"]
    assert ahead.choices[0].text == expected and stats["ahead_steps"] > 0  # drafted ahead, output unchanged


async def test_openai_streamed_chat_equals_grpc_greedy(tiny_http, tiny_dirs):
    stack, base, model = tiny_http
    expected, _ = await grpc_generate(stack, 12, prompt_token_ids=chat_prompt_ids(tiny_dirs["target"]))
    stream = await client(base).chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, stats, usage = "", None, None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            stats = (chunk.model_extra or {}).get("specd", stats)
    assert text == expected
    assert finish == "length" and usage.completion_tokens == 12
    assert stats["steps"] >= 1


async def test_chat_and_completion_without_stream_and_with_stream_agree(tiny_http):
    stack, base, model = tiny_http
    openai_client = client(base)
    whole = await openai_client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "specd": {"draft_tokens": 2}},
    )
    assert whole.choices[0].message.role == "assistant"
    stats = whole.model_extra["specd"]
    assert stats["draft_tokens"] == 2 and "step_verify_seconds" not in stats and "step_draft_seconds" not in stats
    traced = await openai_client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        extra_body={"specd": {"draft_tokens": 2, "drafter": "model", "trace": True}},  # each K > 0 step: a Propose
    )
    traced_stats = traced.model_extra["specd"]
    assert set(traced_stats) == STATS_FIELDS
    draft, verify = traced_stats["step_draft_seconds"], traced_stats["step_verify_seconds"]
    assert len(draft) == len(verify) == traced_stats["steps"] == len(traced_stats["draft_lengths"])
    assert all(seconds > 0 for seconds in verify)  # every step has a target call
    assert all((seconds > 0) == (k > 0) for seconds, k in zip(draft, traced_stats["draft_lengths"]))
    pieces = await openai_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    streamed = "".join([chunk.choices[0].text async for chunk in pieces if chunk.choices])
    plain = await openai_client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "specd": {"draft_tokens": 0}},
    )
    assert streamed == plain.choices[0].text  # speculation on (K=4) and off give the same greedy text
    assert plain.model_extra["specd"]["drafted"] == 0


async def test_server_sent_events_end_with_done(tiny_http):
    _, base, model = tiny_http
    status, body = await http(
        "POST",
        f"{base}/v1/completions",
        {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True},
    )
    assert status == 200
    events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "specd" in chunks[-1]


async def test_models_health_and_wrong_model(tiny_http):
    _, base, model = tiny_http
    status, body = await http("GET", f"{base}/v1/models")
    assert status == 200 and [entry["id"] for entry in json.loads(body)["data"]] == [model]
    assert await http("GET", f"{base}/health") == (200, '{"status":"ok"}')
    status, body = await http("POST", f"{base}/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "path, fields, param, fragment",
    [
        ("completions", {"n": 0}, "n", "integer >= 1"),
        ("completions", {"specd": {"draft_ahead": "maybe"}}, "specd.draft_ahead", "one of auto, on, off"),
        ("completions", {"specd": {"drafter": "oracle"}}, "specd.drafter", "one of hybrid, model, ngram, suffix"),
        ("completions", {"n": 100}, "n", "at most 16"),
        ("completions", {"n": 9, "prompt": ["a", "b"]}, "n", "x 2 prompts asks for 18 choices"),
        ("completions", {"best_of": 3}, "best_of", "choices it returns"),
        ("completions", {"echo": "yes"}, "echo", "true or false"),
        ("completions", {"logprobs": 6}, "logprobs", "0..5"),
        ("completions", {"logprobs": True}, "logprobs", "0..5"),
        ("completions", {"top_logprobs": 2}, "top_logprobs", "unknown field"),
        ("completions", {"suffix": "}"}, "suffix", "suffix"),
        ("completions", {"logit_bias": {"42": 500}}, "logit_bias", "[-100, 100]"),  # served: tests/test_penalties.py
        ("completions", {"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ("completions", {"guided_json": {}}, "guided_json", "unknown field"),
        ("completions", {"temperature": -1}, "temperature", ">= 0"),
        ("completions", {"temperature": "hot"}, "temperature", "finite number"),
        ("completions", {"top_p": 0}, "top_p", "(0, 1]"),
        ("completions", {"max_tokens": 0}, "max_tokens", ">= 1"),
        ("completions", {"seed": -1}, "seed", "seed"),
        ("completions", {"stop": 5}, "stop", "stop"),
        ("completions", {"prompt": ["one", 5]}, "prompt", "a list of those"),
        ("completions", {"prompt": ["ok", [5, 2**32]]}, "prompt", "prompt[1] token id"),
        ("completions", {"prompt": ""}, None, "empty"),
        ("completions", {"max_tokens": 100_000}, "max_tokens", "exceeds the 4096 tokens"),
        ("completions", {"max_tokens": 10**20}, "max_tokens", "exceeds the 4096 tokens"),  # beyond a uint32
        ("completions", {"max_tokens": 4000, "prompt": [13] * 200}, None, "exceeds"),  # prompt + output: the core
        ("completions", {"specd": {"draft_tokens": 99}}, "specd.draft_tokens", "K=99"),
        ("completions", {"specd": {"draft_tokens": 2**40}}, "specd.draft_tokens", "above the largest"),
        ("completions", {"specd": {"k": 2}}, "specd.k", "draft_tokens"),
        ("completions", {"specd": {"trace": "yes"}}, "specd.trace", "true or false"),
        ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        (
            "completions",
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options",
            "true or false",
        ),
        # Lone surrogates: valid JSON ("\ud800"), but no Unicode, so no UTF-8 for the tokenizer (was a 500).
        (
            "completions",
            {"prompt": "\ud800"},
            "prompt",
            "`prompt` is not valid Unicode: it holds a lone surrogate at index 0",
        ),
        ("completions", {"prompt": "ok\udfff"}, "prompt", "lone surrogate at index 2"),
        ("completions", {"stop": ["end", "\ud800"]}, "stop[1]", "not valid Unicode"),
        ("completions", {"user": "\udc00"}, "user", "not valid Unicode"),
        ("completions", {"model": "\ud800"}, "model", "not valid Unicode"),
        ("completions", {"\ud800": 1}, "\\ud800", "the field name `\\ud800` is not valid Unicode"),
        # Values no uint32 or float32 of the GenerateRequest could carry (were 500s).
        ("completions", {"prompt": [5, 2**32]}, "prompt", "outside the vocabulary"),
        ("completions", {"top_k": 2**32}, "top_k", "[-1, 2^32)"),
        ("completions", {"temperature": 1e39}, "temperature", "float32"),
        ("completions", {"model": 5}, "model", "must be a string"),
        ("completions", {"user": ["me"]}, "user", "must be a string"),
        ("completions", {"cache_salt": "s" * 257}, "cache_salt", "cache_salt must be at most 256 characters"),
        ("chat/completions", {"cache_salt": 7}, "cache_salt", "must be a string"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
        ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format", "structured"),
        ("chat/completions", {"n": 17}, "n", "at most 16"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs `logprobs: true`"),
        ("chat/completions", {"logprobs": 3}, "logprobs", "true or false"),
        ("chat/completions", {"echo": True}, "echo", "unknown field"),
        ("chat/completions", {"messages": []}, "messages", "non-empty"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content",
            "`messages[0].content` is not valid Unicode: it holds a lone surrogate at index 0",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]},
            "messages[0].content[0].text",
            "lone surrogate at index 1",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages[0].role",
            '`messages[0].role` = "wizard" is not a chat role: use system, user, assistant, developer',
        ),
        ("chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, "messages[0].role", "no tool calls"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi", "name": 7}]},
            "messages[0].name",
            "string",
        ),
        ("chat/completions", {"max_completion_tokens": 2, "max_tokens": "many"}, "max_tokens", "integer >= 1"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "no images",
        ),
    ],
)
async def test_unsupported_fields_and_bad_values_answer_400(tiny_http, path, fields, param, fragment):
    _, base, model = tiny_http
    body = {"model": model, "max_tokens": 4}
    body.update({"messages": CHAT} if path.startswith("chat") else {"prompt": PROMPT})
    body.update(fields)
    status, text = await http("POST", f"{base}/v1/{path}", body)
    error = json.loads(text)["error"]
    assert status == 400, text
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"], error["message"]


async def test_defaults_and_nulls_are_accepted(tiny_http):
    _, base, model = tiny_http
    status, text = await http(
        "POST",
        f"{base}/v1/completions",
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 3,
            "n": 1,
            "logprobs": None,
            "echo": False,
            "presence_penalty": 0,
            "logit_bias": {},
            "user": "someone",
            "stop": None,
        },
    )
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] <= 3
    status, text = await http("POST", f"{base}/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(text)["error"]["message"]


@pytest.mark.parametrize(
    "body, says",
    [
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),  # deeper than the parser recurses (was a 500)
        (b'{"prompt": "\xed\xa0\x80"}', "lone surrogate"),  # a surrogate's would-be UTF-8 bytes
        ('{"prompt": "\ud800"}'.encode("utf-16-le", "surrogatepass"), "lone surrogate"),  # UTF-16, as JSON may be
        (b"\xff\xfe\xfd", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"null", "must be a JSON object"),
    ],
)
async def test_bodies_that_do_not_parse_into_a_request_answer_400(tiny_http, body, says):
    _, base, _ = tiny_http
    for path in ("completions", "chat/completions"):
        status, text = await http("POST", f"{base}/v1/{path}", body)
        assert status == 400 and says in json.loads(text)["error"]["message"], text


async def test_a_developer_message_is_a_system_message(tiny_http):
    """The target's template knows no `developer` role (it would drop the message): it is rendered as `system`."""
    _, base, model = tiny_http
    answers = []
    for role in ("developer", "system"):
        completion = await client(base).chat.completions.create(
            model=model, messages=[{"role": role, "content": "Be terse."}, CHAT[1]], max_tokens=4, temperature=0
        )
        answers.append((completion.choices[0].message.content, completion.usage.prompt_tokens))
    assert answers[0] == answers[1]


def scrape(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def test_metrics_agree_with_the_per_request_stats(tiny_http):
    stack, base, model = tiny_http
    before = scrape((await http("GET", f"{base}/metrics"))[1])
    openai_client = client(base)
    stats = []
    for k, prompt in ((4, PROMPT), (2, "The capital of France is"), (6, "import numpy as np\n")):
        completion = await openai_client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=14,
            temperature=0,
            extra_body={"ignore_eos": True, "specd": {"draft_tokens": k}},
        )
        stats.append(completion.model_extra["specd"])
    _, final = await grpc_generate(stack, 9, k=3, prompt=PROMPT)
    assert (await http("POST", f"{base}/v1/completions", {"prompt": PROMPT, "n": 0}))[0] == 400  # refused by parse
    assert (await http("POST", f"{base}/v1/completions", {"prompt": ""}))[0] == 400  # refused by the core
    after = scrape((await http("GET", f"{base}/metrics"))[1])

    accepted = sum(s["accepted"] for s in stats) + final.stats.accepted
    assert delta(after, before, "specd_spec_decode_num_accepted_tokens_total") == accepted > 0
    assert (
        delta(after, before, "specd_spec_decode_num_draft_tokens_total")
        == sum(s["drafted"] for s in stats) + final.stats.drafted
    )
    drafts = delta(after, before, "specd_spec_decode_num_drafts_total")
    assert drafts == sum(s["drafting_steps"] for s in stats) + final.stats.drafting_steps > 0
    per_position = [0] * 6
    for accepted_per_position in [s["accepted_per_position"] for s in stats] + [final.stats.accepted_per_position]:
        for position, count in enumerate(accepted_per_position):
            per_position[position] += count
    for position, count in enumerate(per_position):
        name = f'specd_spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}}'
        assert delta(after, before, name) == count, position
    assert delta(after, before, 'specd_requests_total{api="http",outcome="length"}') == 3
    assert delta(after, before, 'specd_requests_total{api="grpc",outcome="length"}') == 1
    assert delta(after, before, 'specd_requests_total{api="http",outcome="INVALID_ARGUMENT"}') == 2
    assert delta(after, before, "specd_e2e_request_latency_seconds_count") == 4
    assert delta(after, before, "specd_time_to_first_token_seconds_count") == 4
    assert delta(after, before, "specd_generation_tokens_total") == 3 * 14 + 9
    steps = sum(s["steps"] for s in stats) + final.stats.steps
    assert delta(after, before, 'specd_step_seconds_count{phase="verify"}') == steps
    assert delta(after, before, 'specd_step_seconds_count{phase="network"}') == steps
    assert after["specd_requests_running"] == 0


async def test_services_export_calls_sessions_and_batches(tiny_http):
    stack, _, _ = tiny_http
    await grpc_generate(stack, 6, prompt=PROMPT)
    for server, method in ((stack.services.draft_server, "Propose"), (stack.services.target_server, "Verify")):
        exporter = start_exporter(server.metrics.registry, "127.0.0.1", 0)
        try:
            status, text = await http("GET", f"http://127.0.0.1:{exporter.server_port}/metrics")
        finally:
            exporter.shutdown()
        samples = scrape(text)
        assert status == 200
        assert samples[f'specd_service_calls_total{{code="OK",method="{method}"}}'] > 0
        assert samples[f'specd_service_call_seconds_count{{method="{method}"}}'] > 0
        assert "specd_sessions_open" in samples and "specd_queue_depth" in samples
        assert re.search(r'specd_batch_size_bucket\{le="\+Inf"\}', text)


@pytest.mark.real
async def test_real_pair_openai_completion_and_streamed_chat_equal_grpc(real_stack):
    """The issue's acceptance test: the official client against the real pair, greedy == gRPC."""
    from specd.model.store import resolve_tokenizer

    http_api = HttpApi(real_stack.orchestrator.core)
    port = await http_api.start("127.0.0.1", 0)
    try:
        base, model = f"http://127.0.0.1:{port}", http_api.api.model_name
        assert model == "qwen2.5-coder-1.5b-instruct"
        expected, _ = await grpc_generate(real_stack, 24, prompt=PROMPT)
        completion = await client(base).completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        assert completion.choices[0].text == expected
        assert completion.model_extra["specd"]["acceptance_rate"] > 0.3

        expected, _ = await grpc_generate(
            real_stack, 24, prompt_token_ids=chat_prompt_ids(resolve_tokenizer("target")), ignore_eos=False
        )
        stream = await client(base).chat.completions.create(
            model=model, messages=CHAT, max_tokens=24, temperature=0, stream=True
        )
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert text and text == expected
    finally:
        await http_api.stop()


def self_signed(folder) -> tuple[bytes, bytes]:
    """A certificate for 127.0.0.1 and its key (PEM), made by the openssl command."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert.read_bytes(), key.read_bytes()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_token_and_tls_guard_the_api_but_not_health(tiny_stack, tmp_path):
    cert, key = self_signed(tmp_path)
    http_api = HttpApi(tiny_stack.orchestrator.core, token="s3cret", tls=(cert, key))
    port = await http_api.start("127.0.0.1", 0)
    trusted = ssl.create_default_context(cadata=cert.decode())
    try:
        base = f"https://127.0.0.1:{port}"
        status, text = await http("GET", f"{base}/v1/models", context=trusted)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
        status, _ = await http("GET", f"{base}/v1/models", headers={"Authorization": "Bearer s3cret"}, context=trusted)
        assert status == 200
        assert (await http("GET", f"{base}/health", context=trusted))[0] == 200
    finally:
        await http_api.stop()


async def send_and_leave(port: int, path: str, body: dict, leave_after) -> None:
    """POST over a raw connection, wait for `leave_after(reader)`, then drop the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    try:
        await leave_after(reader)
    finally:  # a failed check leaves too: a request left running would hold sessions into the next tests
        writer.close()
        await writer.wait_closed()


async def sessions_released(stack, timeout_s: float = 20.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await stack.live_sessions() == (0, 0):
            return True
        await asyncio.sleep(0.2)
    return False


async def test_a_client_that_leaves_cancels_its_request(tiny_http):
    """Streamed or not, a dropped connection stops generation and frees both services' sessions."""
    stack, base, model = tiny_http
    port = int(base.rsplit(":", 1)[1])
    before = scrape((await http("GET", f"{base}/metrics"))[1])
    long = {"model": model, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    long["specd"] = {"draft_tokens": 4, "drafter": "model"}  # both sessions open from the first step

    async def first_chunk(reader):
        while not (await reader.readline()).startswith(b"data: "):
            pass

    async def some_work(reader):
        await asyncio.sleep(1.5)
        assert await stack.live_sessions() == (1, 1)  # it is generating

    await send_and_leave(port, "/v1/completions", {**long, "stream": True}, first_chunk)
    assert await sessions_released(stack)
    await send_and_leave(port, "/v1/completions", long, some_work)
    assert await sessions_released(stack)
    after = scrape((await http("GET", f"{base}/metrics"))[1])
    assert delta(after, before, 'specd_requests_total{api="http",outcome="cancelled"}') == 2
    assert delta(after, before, "specd_generation_tokens_total") == 0


async def test_a_refused_request_gets_its_http_status_streamed_or_not(tiny_http):
    """RESOURCE_EXHAUSTED from the pool (here: a limit of 0 requests in flight) is HTTP 429."""
    stack, base, model = tiny_http
    pool = stack.orchestrator.pool
    saved, pool.max_requests = pool.max_requests, 0
    try:
        for stream in (False, True):
            status, text = await http(
                "POST", f"{base}/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2, "stream": stream}
            )
            error = json.loads(text)["error"]
            assert status == 429 and error["code"] == "RESOURCE_EXHAUSTED" and "limit" in error["message"]
        with pytest.raises(openai.RateLimitError):
            await client(base).completions.create(model=model, prompt=PROMPT, max_tokens=2)
    finally:
        pool.max_requests = saved


# -- the prefix cache over HTTP, against a fake pool (no models) ---------------------------------------


class CachedPool:
    """A worker pool whose target took `cached` of each prompt's tokens from its prefix cache."""

    def __init__(self, cached: int):
        self.actors, self.requests, self.cached = ["a"], [], cached

    async def generate(self, request):
        from specd.orchestrator.request import Delta, Finished, Stats

        self.requests.append(request)
        yield Delta(" hi", [1])
        stats = Stats(steps=1, draft_lengths=[0], step_seconds=[(0.0, 0.1, 0.0)])
        yield Finished("length", len(request.prompt_ids), 1, stats, cached_prompt_tokens=self.cached)


@pytest.fixture
async def cached_http():
    """An HTTP API over the core of test_core.py (a word-level tokenizer, fake services) and a CachedPool."""
    from test_core import core

    served = core()
    served.pool = CachedPool(cached=2)
    served.pair.tokenizer_config = {"chat_template": "{% for m in messages %}{{ m.content }} {% endfor %}"}
    http_api = HttpApi(served)
    port = await http_api.start("127.0.0.1", 0)
    yield served.pool, f"http://127.0.0.1:{port}"
    await http_api.stop()


async def test_cache_salt_reaches_the_request_and_cached_tokens_the_usage(cached_http):
    pool, base = cached_http
    completion = await client(base).completions.create(
        model="target-model", prompt="hello world again", max_tokens=2, extra_body={"cache_salt": "tenant-a"}
    )
    assert pool.requests[-1].cache_salt == "tenant-a"
    assert completion.usage.prompt_tokens == 3 and completion.usage.prompt_tokens_details.cached_tokens == 2
    status, text = await http("POST", f"{base}/v1/completions", {"prompt": "hello world", "max_tokens": 2, "n": 3})
    assert status == 200 and pool.requests[-1].cache_salt == ""  # no salt: the shared prefixes
    assert json.loads(text)["usage"] == {
        "prompt_tokens": 2,  # one prompt, counted once over its 3 choices; so are its cached tokens
        "completion_tokens": 3,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    status, text = await http("POST", f"{base}/v1/completions", {"prompt": ["hello", "world again"]})
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


async def test_a_streamed_chat_sends_cached_tokens_in_its_usage_chunk(cached_http):
    pool, base = cached_http
    stream = await client(base).chat.completions.create(
        model="target-model",
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": "tenant-b"},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 2
    assert pool.requests[-1].cache_salt == "tenant-b"
    status, text = await http(
        "POST",
        f"{base}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "s" * 300},
    )
    assert status == 400 and json.loads(text)["error"]["param"] == "cache_salt", text
