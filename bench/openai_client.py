"""The client side of any OpenAI-compatible server (vLLM, llama.cpp's llama-server, TGI, SGLang, specd's
own HTTP API) for the load tester (`specd loadtest --openai URL`) and the peer benchmark (`specd bench
--peer NAME=URL`): one streamed `POST /v1/completions`, timed on the client as the load tester times a
gRPC Generate. The official `openai` package does the HTTP, the server-sent events and the errors.

Every request streams (`stream: true`, `stream_options: {"include_usage": true}`) with `max_tokens`,
the temperature (0: greedy), a seed, and `ignore_eos` in the body (vLLM's and llama-server's name for
it, as specd's HTTP API takes it) unless the caller lets requests stop at end-of-sequence. Measured
per request:

- TTFT: from sending the request to the first chunk that carries text;
- one delta per chunk that carries text; the inter-token latency is the gap between two such
  chunks, as vLLM's `bench serve` counts it (a server that sends several tokens in one chunk, as
  specd does after a speculative step, shows fewer, longer gaps: the chunk's token count is not
  on the wire);
- completion and prompt tokens: the stream's `usage` where the server sends it, else the chunks
  with text counted (and no prompt count);
- the prompt tokens served from the server's prefix cache: `usage.prompt_tokens_details.cached_tokens`
  (vLLM, llama-server, specd), else llama-server's `timings.cache_n` on the last chunk; None where
  neither comes (llama-server's `tokens_cached` counts the whole slot, output included: not used);
- errors: the HTTP status (`HTTP_503`), or the openai package's exception name
  (`APIConnectionError`, `APITimeoutError`, ...); a stream without a finish reason is
  `NO_FINISH_REASON`.

A server that refuses connections, or names no model when none is given, is a `TargetError` when
the target opens, before any request is sent: a load test of nothing would only count errors.
"""

import asyncio
import os
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import openai

from specd.bench.workload import RequestResult, Settings


class TargetError(ValueError):
    """An OpenAI-compatible target that cannot be used: a malformed URL, a server that refuses
    connections or wants a key, or no model to ask for."""


def base_url(url: str) -> str:
    """`http://host:port`, `http://host:port/v1` or either with a trailing slash -> `http://host:port/v1`,
    the base the openai client takes; a TargetError for anything but an http(s) URL with a host."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TargetError(f"{url!r} is not an http(s) URL: give one such as http://127.0.0.1:8000 (/v1 optional)")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def make_client(url: str, api_key: str | None = None, timeout: float = 600.0) -> openai.AsyncOpenAI:
    """An AsyncOpenAI for the server at `url`, no retries (a load test counts failures, it does not hide
    them). The key: `api_key`, else $OPENAI_API_KEY, else "EMPTY" (a server without auth ignores it)."""
    key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return openai.AsyncOpenAI(base_url=base_url(url), api_key=key, timeout=timeout, max_retries=0)


async def served_models(client: openai.AsyncOpenAI, what: str) -> list[str]:
    """The model ids `GET /v1/models` lists ([] where the server answers it with an error: some have
    no such endpoint); a TargetError naming `what` where the server cannot be reached or wants a key."""
    try:
        page = await client.models.list()
    except openai.APIConnectionError as error:
        raise TargetError(
            f"{what}: cannot connect to {client.base_url} ({root_cause(error)}); is the server running there?"
        ) from None
    except openai.AuthenticationError:
        raise TargetError(
            f"{what}: {client.base_url} refused the API key (HTTP 401): give the right --api-key"
        ) from None
    except openai.APIStatusError:
        return []
    return [model.id for model in page.data]


async def pick_model(client: openai.AsyncOpenAI, model: str | None, what: str) -> tuple[str, list[str]]:
    """The model to ask for (`model`, else the first the server lists) and the ids it lists."""
    models = await served_models(client, what)
    if model:
        return model, models
    if not models:
        raise TargetError(f"{what}: {client.base_url}models lists no model: name one with --model")
    return models[0], models


def root_cause(error: BaseException) -> str:
    """The innermost exception's text (e.g. `[Errno 111] Connection refused` under the client's
    `Connection error.`)."""
    while error.__cause__ or error.__context__:
        error = error.__cause__ or error.__context__
    return str(error) or type(error).__name__


@dataclass
class Streamed:
    """One streamed completion as the client saw it (perf_counter seconds)."""

    started: float
    ended: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    text: str = ""
    completion_tokens: int = 0  # usage's where the server sent it, else the chunks with text
    prompt_tokens: int | None = None  # usage's, None where the server sent none
    cached_prompt_tokens: int | None = None  # of those, served from the server's prefix cache (None: not said)
    finish_reason: str | None = None


async def stream_completion(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = True,
    timeout: float = 600.0,
) -> Streamed:
    """Stream one completion to its end, timing each chunk; raises the openai package's errors."""
    options = {"seed": seed} if seed is not None else {}
    streamed = Streamed(started=time.perf_counter())
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if ignore_eos else None,
        timeout=timeout,
        **options,
    )
    usage = timings = None
    async with stream:
        async for chunk in stream:
            now = time.perf_counter()
            usage = chunk.usage or usage
            timings = getattr(chunk, "timings", None) or timings  # llama-server's, beside the usage
            for choice in chunk.choices[:1]:  # one choice asked for
                if choice.text:
                    streamed.chunk_times.append(now)
                    streamed.text += choice.text
                streamed.finish_reason = choice.finish_reason or streamed.finish_reason
    streamed.ended = time.perf_counter()
    streamed.completion_tokens = usage.completion_tokens if usage else len(streamed.chunk_times)
    streamed.prompt_tokens = usage.prompt_tokens if usage else None
    streamed.cached_prompt_tokens = cached_tokens(usage, timings)
    return streamed


def cached_tokens(usage, timings) -> int | None:
    """The prompt tokens a server says it served from its cache: usage.prompt_tokens_details.cached_tokens,
    else llama-server's timings.cache_n; None where the stream said neither."""
    details = getattr(usage, "prompt_tokens_details", None)
    if getattr(details, "cached_tokens", None) is not None:
        return int(details.cached_tokens)
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        return timings["cache_n"]
    return None


def error_name(error: Exception) -> str:
    """How a failed request is counted: `HTTP_<status>` for an error status, else the exception's class."""
    if isinstance(error, openai.APIStatusError):
        return f"HTTP_{error.status_code}"
    return type(error).__name__


class OpenAiTarget:
    """A load-test target (bench/loadtest.py's GrpcTarget is the other): an OpenAI-compatible server's
    `/v1/completions`. Its runs carry no speculation figures: nothing on the wire says what the server drafted."""

    backend = "openai"
    speculation = False

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None):
        self.url = url.strip().rstrip("/")
        base_url(self.url)  # a malformed URL fails here, before anything runs
        self.model, self.api_key = model, api_key
        self.name = self.url + (f" ({model})" if model else "")
        self.client: openai.AsyncOpenAI | None = None
        self.models: list[str] = []

    async def open(self, timeout: float) -> None:
        """Connect and choose the model (TargetError where the server cannot be used)."""
        self.client = make_client(self.url, self.api_key, timeout)
        try:
            self.model, self.models = await pick_model(self.client, self.model, f"--openai {self.url}")
        except TargetError:
            await self.client.close()
            raise

    async def close(self) -> None:
        if self.client:
            await self.client.close()

    async def send(self, settings: Settings, index: int) -> RequestResult:
        """Request number `index` (the prompts in turn, seed + index), as the gRPC target sends it."""
        result = RequestResult(started=time.perf_counter(), index=index)
        try:
            async with asyncio.timeout(settings.timeout + 5):  # the client's own timeout should fire first
                streamed = await stream_completion(
                    self.client,
                    self.model,
                    settings.prompt(index),
                    settings.max_new_tokens,
                    settings.temperature,
                    settings.seed + index,
                    settings.ignore_eos,
                    settings.timeout,
                )
        except TimeoutError:
            result.error = "APITimeoutError"
        except Exception as error:  # a load test counts what goes wrong and carries on
            result.error = error_name(error)
        else:
            result.started = streamed.started
            result.delta_times = streamed.chunk_times
            result.delta_tokens = [1] * len(streamed.chunk_times)  # per chunk: vLLM's ITL (module docstring)
            result.completion_tokens = streamed.completion_tokens
            result.prompt_tokens = streamed.prompt_tokens
            result.cached_prompt_tokens = streamed.cached_prompt_tokens
            result.text = streamed.text
            if streamed.finish_reason is None:
                result.error = "NO_FINISH_REASON"
        result.ended = time.perf_counter()
        return result

    async def passes(self, timeout: float) -> None:
        """Batched passes are specd's services' figure: none here."""
        return None

    def describe(self) -> dict:
        return {"name": self.name, "backend": self.backend, "url": self.url, "model": self.model, "models": self.models}
