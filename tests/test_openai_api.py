"""The OpenAI-compatible HTTP API: the official `openai` client against it, greedy output equal to
the gRPC API's, streamed or not, over the real pair too; a token and TLS; a client that leaves or
is refused; cache_salt and cached tokens. Its requests' 400s are tests/test_openai_request.py's, the
Prometheus counters tests/test_metrics.py's."""

import asyncio
import json
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
from specd.v1 import common_pb2, specdecode_pb2

PROMPT = "def quicksort(arr):"
STATS_FIELDS = {field.name for field in specdecode_pb2.SpeculationStats.DESCRIPTOR.fields}
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Write a Python function that reverses a string."},
]


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


async def test_openai_completion_equals_grpc_greedy(tiny_stack, tiny_http):
    stack, (base, model) = tiny_stack, tiny_http
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


async def test_openai_streamed_chat_equals_grpc_greedy(tiny_stack, tiny_http, tiny_dirs):
    stack, (base, model) = tiny_stack, tiny_http
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
    base, model = tiny_http
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
    base, model = tiny_http
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


@pytest.mark.real
async def test_real_pair_openai_completion_and_streamed_chat_equal_grpc(real_stack):
    """The issue's acceptance test: the official client against the real pair, greedy == gRPC."""
    from specd.model.fetch import resolve_tokenizer

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


async def test_a_client_that_leaves_cancels_its_request(tiny_stack, tiny_http):
    """Streamed or not, a dropped connection stops generation and frees both services' sessions."""
    stack, (base, model) = tiny_stack, tiny_http
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


async def test_a_refused_request_gets_its_http_status_streamed_or_not(tiny_stack, tiny_http):
    """RESOURCE_EXHAUSTED from the pool (here: a limit of 0 requests in flight) is HTTP 429."""
    stack, (base, model) = tiny_stack, tiny_http
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
