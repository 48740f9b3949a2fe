"""The OpenAI-compatible HTTP API, served by the orchestrator next to gRPC.

    POST /v1/completions        prompt -> text           (stream: true for server-sent events)
    POST /v1/chat/completions   messages -> reply        (the target's chat template)
    GET  /v1/models             the one model served
    GET  /health                200 while serving, 503 while draining
    GET  /metrics               the orchestrator's Prometheus metrics

Each request is translated into a specd.v1 GenerateRequest and goes through core.py, as a gRPC
request does (the same checks and limits, the same WorkerPool), so greedy output over HTTP equals
greedy output over gRPC.

`n` choices per prompt and a list of prompts (completions) run as concurrent requests, choice
index = prompt × n + choice, each with a seed of its own: a given `seed` + the choice's number, or
a fresh one (every choice reports its `seed`). `logprobs` (and `echo`) are the target's own
(openai_response.py). Fields OpenAI defines but specd does not do (best_of, suffix, tools, ...) answer
400 naming the field, as do fields OpenAI does not define; null means "not set". So do a lone
surrogate in any string (valid JSON, but no Unicode), a value no GenerateRequest field carries,
and a chat role other than system, user, assistant and developer (rendered as system). Extensions:
`top_k`, `ignore_eos` (as in vLLM) and
`"specd": {"draft_tokens": K, "drafter": "ngram", "draft_ahead": "on", "trace": true}` (K = 0 turns
speculation off; drafter: model, ngram, suffix or hybrid; draft_ahead: auto, on or off, ahead.py;
trace adds each step's draft and verify seconds). Every response (each choice's last chunk, when
streaming) carries the request's speculation stats in `"specd"`, named as the gRPC Final's
SpeculationStats (core.stats_dict); with several choices, each choice carries its own.
"""

import asyncio
import hmac
import json
import math
import socket
import tempfile
import time
import uuid
from contextlib import aclosing, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specd.orchestrator.core import BadRequest, Core, stats_dict
from specd.orchestrator.drain import DRAINING
from specd.orchestrator.generation import Delta, Finished
from specd.orchestrator.openai_request import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    UNSUPPORTED,
    ApiError,
    chat_message,
    choices_per_prompt,
    compile_chat_template,
    extension,
    is_int,
    logprobs_asked,
    sampling_params,
    shown,
    stop_strings,
    streaming,
    token_text,
    typed_field,
    valid_unicode,
)
from specd.orchestrator.openai_response import LogprobsFormat, Scored, prompt_scored
from specd.orchestrator.worker import RETRY_AFTER_S, Failed
from specd.proto import tracing
from specd.v1 import specdecode_pb2

API_LABEL = "http"  # the `api` label of this API's requests in the metrics
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there

STATUS_OF_CODE = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


@dataclass
class Choice:
    """One choice of a request: a request of its own to the core, and its prompt for `echo`."""

    message: specdecode_pb2.GenerateRequest
    prompt: int = 0  # which prompt of the request (usage counts each prompt once)
    echo: str = ""  # the prompt's text, prepended to the choice's text when echoed
    echo_ids: list[int] = field(default_factory=list)  # its token ids, when echoed with logprobs


@dataclass
class Call:
    """One parsed HTTP request: what to generate and how to answer."""

    chat: bool
    choices: list[Choice]  # by OpenAI's index: prompt i, choice j -> i * n + j
    stream: bool = False
    include_usage: bool = False
    trace: bool = False  # add each step's seconds to the stats
    logprobs: int | None = None  # None: none; else the alternatives asked per position
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"


class OpenAiApi:
    """Translates OpenAI requests for the core (which owns the pair and the pool) and its answers back."""

    def __init__(self, core: Core, model_name: str | None = None):
        self.core = core
        self.model_name = model_name or core.model_name
        config = core.tokenizer_config
        self.chat_template = compile_chat_template(config.get("chat_template"))
        self.special_tokens = {name: token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        self.draining = False

    # -- parsing ---------------------------------------------------------------------------

    def parse(self, body, chat: bool) -> Call:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        valid_unicode(body)
        body = {name: value for name, value in body.items() if value is not None}  # null = not set
        allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
        for name, value in body.items():
            if name in UNSUPPORTED:
                defaults, reason = UNSUPPORTED[name]
                if value not in defaults:
                    raise ApiError(400, f"`{name}` = {shown(value)} is not supported: {reason}", name)
            elif name not in allowed:
                endpoint = "/v1/chat/completions" if chat else "/v1/completions"
                raise ApiError(
                    400, f"unknown field `{name}` for {endpoint}; specd takes {', '.join(sorted(allowed))}", name
                )
        typed_field(body, "user", str, "")
        model = typed_field(body, "model", str, self.model_name)
        if model != self.model_name:
            raise ApiError(
                404,
                f"the model `{model}` does not exist here; this server serves `{self.model_name}` (GET /v1/models)",
                "model",
                "model_not_found",
            )
        message = specdecode_pb2.GenerateRequest(ignore_eos=typed_field(body, "ignore_eos", bool, False))
        prompts = [self.chat_prompt(body.get("messages"))] if chat else self.completion_prompts(body.get("prompt"))
        n = choices_per_prompt(body, len(prompts))
        echo = not chat and typed_field(body, "echo", bool, False)
        logprobs = logprobs_asked(body, chat)
        message.max_new_tokens = self.max_tokens(body, chat, len(prompts[0]) if chat else 0)  # chat: its ids
        message.sampling.CopyFrom(sampling_params(body))
        message.stop.extend(stop_strings(body))
        k, message.drafter, message.draft_ahead, trace = extension(body, self.core.services_max_k)
        if k is not None:
            message.draft_tokens = k
        if logprobs is not None:
            message.logprobs, message.top_logprobs, message.prompt_logprobs = True, logprobs, echo
        choices = [
            self.choice(message, index, prompt, j, echo) for index, prompt in enumerate(prompts) for j in range(n)
        ]
        return Call(chat, choices, *streaming(body), trace=trace, logprobs=logprobs)

    def choice(self, message: specdecode_pb2.GenerateRequest, index: int, prompt, j: int, echo: bool) -> Choice:
        """Choice j of prompt `index`: with a seed given, its own seed + j (reproducible, and the
        choices differ); without, the core draws one for each."""
        own = specdecode_pb2.GenerateRequest()
        own.CopyFrom(message)
        if isinstance(prompt, str):
            own.prompt = prompt  # tokenized by the core, as a gRPC prompt is
        else:
            own.prompt_token_ids.extend(prompt)
        if message.sampling.HasField("seed"):
            own.sampling.seed = (message.sampling.seed + j) % 2**64
        choice = Choice(own, index)
        if echo:
            ids = (
                prompt if isinstance(prompt, list) else self.core.tokenizer.encode(prompt, add_special_tokens=False).ids
            )
            choice.echo = (
                prompt if isinstance(prompt, str) else self.core.tokenizer.decode(ids, skip_special_tokens=False)
            )
            choice.echo_ids = list(ids) if message.logprobs else []
        return choice

    def completion_prompts(self, prompt) -> list:
        """`prompt`: a string, token ids, or a list of several of those (each a prompt of its own)."""
        if prompt is None:
            raise ApiError(400, "`prompt` is required", "prompt")
        several = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
        prompts = prompt if several else [prompt]
        return [self.completion_prompt(p, f"prompt[{i}]" if several else "prompt") for i, p in enumerate(prompts)]

    def completion_prompt(self, prompt, where: str):
        """One prompt: its text, or its token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
            vocab_size = self.core.pair.target_info.vocab_size
            if max(prompt) >= vocab_size:  # also what a uint32 cannot carry
                raise ApiError(
                    400, f"{where} token id {shown(max(prompt))} is outside the vocabulary of {vocab_size}", "prompt"
                )
            return prompt
        if prompt == []:
            return []  # the core refuses it: the prompt is empty
        raise ApiError(
            400, "`prompt` must be a string, a list of token ids (integers >= 0), or a list of those", "prompt"
        )

    def chat_prompt(self, messages) -> list[int]:
        """Render the messages with the target's chat template, then tokenize (special tokens included)."""
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "`messages` must be a non-empty list of {role, content} objects", "messages")
        plain = [chat_message(entry, index) for index, entry in enumerate(messages)]
        if self.chat_template is None:
            raise ApiError(400, "the target's tokenizer has no chat template; use /v1/completions", "messages")
        try:
            text = self.chat_template.render(
                messages=plain, add_generation_prompt=True, tools=None, **self.special_tokens
            )
        except TemplateError as error:
            raise ApiError(400, f"the chat template could not render these messages: {error}", "messages") from None
        return self.core.tokenizer.encode(text, add_special_tokens=False).ids

    def max_tokens(self, body: dict, chat: bool, prompt_tokens: int) -> int:
        """`max_completion_tokens`, else `max_tokens` (both checked), else OpenAI's default: 16 for
        completions; for chat, as many as fit."""
        given = [name for name in ("max_completion_tokens", "max_tokens") if name in body]
        for name in given:
            value = body[name]
            if not is_int(value) or value < 1:
                raise ApiError(400, f"`{name}` must be an integer >= 1, got {shown(value)}", name)
            if value > self.core.room:  # also what a uint32 cannot carry
                raise ApiError(
                    400,
                    f"`{name}` = {shown(value)} exceeds the {self.core.room} tokens a session may hold "
                    "(prompt and output); ask for fewer tokens",
                    name,
                )
        if not given:
            return COMPLETION_DEFAULT_MAX_TOKENS if not chat else max(1, self.core.room - prompt_tokens)
        return body[given[0]]

    # -- answering -------------------------------------------------------------------------

    def start(self, call: Call) -> list:
        """Validate every choice as every API does, then start generating; the events of each choice."""
        try:
            return [self.core.start(choice.message, API_LABEL) for choice in call.choices]
        except BadRequest as error:  # nothing ran yet: a request's events start when first read
            raise ApiError(400, str(error), error.param) from None

    async def complete(self, call: Call) -> dict:
        """Every choice run concurrently to its end; one failure cancels the others."""
        runs = self.start(call)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._collect(call, index, events)) for index, events in enumerate(runs)]
        except* ApiError as failures:
            raise failures.exceptions[0] from None
        choices, stats = zip(*(task.result() for task in tasks))
        finished = {index: done for index, (done, _) in enumerate(stats)}
        answer = {
            "id": call.id,
            "object": "chat.completion" if call.chat else "text_completion",
            "created": call.created,
            "model": self.model_name,
            "choices": list(choices),
            "usage": usage(call, finished),
        }
        if len(choices) == 1:
            answer["specd"] = stats[0][1]
        else:
            for choice, (_, own) in zip(choices, stats):
                choice["specd"] = own
        return answer

    async def _collect(self, call: Call, index: int, events) -> tuple[dict, tuple[Finished, dict]]:
        """One choice's events -> (its choice object, (its Finished, its stats))."""
        choice, text, scored, finished = call.choices[index], "", Scored(), None
        echoed = None
        async with aclosing(events):
            async for event in events:
                if isinstance(event, Failed):
                    raise _failed(event)
                if isinstance(event, Delta):
                    text += event.text
                    scored.add(event.token_ids, event.logprobs, event.top_logprobs)
                    if echoed is None:
                        echoed = prompt_scored(choice.echo_ids, event.prompt_logprobs, event.prompt_top_logprobs)
                else:
                    finished = event
        answer = {"index": index, "finish_reason": finished.reason, "logprobs": None, "seed": finished.seed}
        if call.chat:
            answer["message"] = {"role": "assistant", "content": text}
        else:
            answer["text"] = choice.echo + text
        if call.logprobs is not None:
            logprobs = LogprobsFormat(self.core.tokenizer, call.chat, call.logprobs)
            if choice.echo_ids and echoed:
                echoed.add(scored.token_ids, scored.logprobs, scored.top)
                scored = echoed
            answer["logprobs"] = logprobs.format(scored)
        return answer, (finished, stats_dict(finished.stats, steps=call.trace))

    async def stream(self, call: Call):
        """Server-sent events; each choice's first event is awaited before the response starts, so
        an error that ends a request before any output still gets its own HTTP status."""
        runs = self.start(call)
        firsts = await asyncio.gather(*(anext(events) for events in runs))
        failed = next((first for first in firsts if isinstance(first, Failed)), None)
        if failed:
            for events in runs:
                await events.aclose()
            raise _failed(failed)
        return StreamingResponse(
            self._sse(call, list(zip(firsts, runs))),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _sse(self, call: Call, runs: list):
        """The stream's chunks: per choice (chat: the role,) (the echoed prompt,) text deltas, the
        finish with its seed and stats; then (usage,) [DONE]. The choices' chunks interleave as they
        come. A client that leaves cancels every choice: their generation loops stop."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, first, events) -> None:
            event = first
            async with aclosing(events):
                while event is not None:
                    await queue.put((index, event))
                    event = await anext(events, None)
            await queue.put((index, None))

        pumps = [asyncio.create_task(pump(index, *run)) for index, run in enumerate(runs)]
        formats = [LogprobsFormat(self.core.tokenizer, call.chat, call.logprobs or 0) for _ in runs]
        started, finished, running, failed = set(), {}, len(runs), False
        try:
            if call.chat:
                for index in range(len(runs)):
                    yield _event(self._chunk(call, index, {"role": "assistant", "content": ""}))
            while running and not failed:
                index, event = await queue.get()
                if event is None:
                    running -= 1
                elif isinstance(event, Failed):
                    yield _event(_failed(event).body())
                    failed = True  # the others stop too (finally)
                elif isinstance(event, Delta):
                    if index not in started:
                        started.add(index)
                        chunk = self._echo_chunk(call, index, event, formats[index])
                        if chunk:
                            yield _event(chunk)
                    if event.text or (call.logprobs is not None and event.token_ids):
                        chunk = self._chunk(call, index, {"content": event.text} if call.chat else event.text)
                        if call.logprobs is not None:
                            scored = Scored()
                            scored.add(event.token_ids, event.logprobs, event.top_logprobs)
                            chunk["choices"][0]["logprobs"] = formats[index].format(scored)
                        yield _event(chunk)
                else:
                    finished[index] = event
                    last = self._chunk(call, index, {} if call.chat else "", event.reason)
                    last["choices"][0]["seed"] = event.seed
                    last["specd"] = stats_dict(event.stats, steps=call.trace)
                    yield _event(last)
            if call.include_usage and not failed:
                yield _event({**self._chunk(call, 0, None), "choices": [], "usage": usage(call, finished)})
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def _echo_chunk(self, call: Call, index: int, first: Delta, logprobs: LogprobsFormat) -> dict | None:
        """The echoed prompt of a completion choice, before its first tokens (None: not echoed)."""
        choice = call.choices[index]
        if call.chat or not choice.echo:
            return None
        chunk = self._chunk(call, index, choice.echo)
        if call.logprobs is not None:
            scored = prompt_scored(choice.echo_ids, first.prompt_logprobs, first.prompt_top_logprobs)
            chunk["choices"][0]["logprobs"] = logprobs.format(scored)
        return chunk

    def _chunk(self, call: Call, index: int, delta, finish: str | None = None) -> dict:
        choice = {"index": index, "finish_reason": finish, "logprobs": None, ("delta" if call.chat else "text"): delta}
        return {
            "id": call.id,
            "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created,
            "model": self.model_name,
            "choices": [choice],
        }

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "specd",
                    "max_model_len": self.core.room,
                }
            ],
        }


def create_app(api: OpenAiApi, registry, token: str | None = None) -> FastAPI:
    """With `token`, /v1/* needs `Authorization: Bearer <token>` (the OpenAI SDK's api_key);
    /health and /metrics stay open, like grpc.health.v1."""
    app = FastAPI(title="specd", docs_url=None, redoc_url=None, openapi_url=None)
    expected = f"Bearer {token}".encode() if token else None

    @app.exception_handler(ApiError)
    async def refuse(request: Request, error: ApiError):
        return error.response()

    def authorize(request: Request) -> None:
        """Each /v1 endpoint checks the token itself: an HTTP middleware would hide a client's
        disconnect from the endpoint (Starlette's BaseHTTPMiddleware wraps `receive`)."""
        given = request.headers.get("authorization", "").encode()
        if expected and not hmac.compare_digest(given, expected):
            reason = "the bearer token is wrong" if given else "no `Authorization: Bearer <token>` header"
            raise ApiError(401, f"{reason}: this server requires a token", code="invalid_api_key")

    async def generate(request: Request, chat: bool):
        authorize(request)
        if api.draining:  # before the body is read: a draining server takes no new work (drain.py)
            api.core.rejected(API_LABEL, "UNAVAILABLE")
            raise Refused(f"UNAVAILABLE: {DRAINING}", "UNAVAILABLE", RETRY_AFTER_S)
        try:
            try:
                body = await request.json()
            except (ValueError, RecursionError) as error:  # RecursionError: nested too deeply
                raise ApiError(400, f"the request body is not valid JSON: {error}") from None
            call = api.parse(body, chat)
        except ApiError as error:
            api.core.rejected(API_LABEL, "NOT_FOUND" if error.status == 404 else "INVALID_ARGUMENT")
            raise
        if call.stream:
            return await api.stream(call)
        return await _unless_disconnected(request, api.complete(call))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return api.models()

    @app.get("/health")
    async def healthy():
        if api.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _unless_disconnected(request: Request, completing) -> Response:
    """Await a non-streamed completion, cancelling it (and its generation loop) if the client leaves."""
    task = asyncio.ensure_future(completing)
    while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)  # nobody reads it: the client is gone
    return JSONResponse(task.result())


class HttpApi:
    """uvicorn serving the API inside the orchestrator's own event loop; HTTPS with `tls` (PEM
    certificate chain, PEM key), as the orchestrator's gRPC port has."""

    def __init__(
        self,
        core: Core,
        model_name: str | None = None,
        token: str | None = None,
        tls: tuple[bytes, bytes] | None = None,
    ):
        self.api = OpenAiApi(core, model_name)
        self.app = create_app(self.api, core.metrics.registry, token)
        self.tls = tls
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind (port 0 picks a free one) and serve; returns the port."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        if self.tls:  # uvicorn reads PEM from files; they are needed only while it loads them
            with tempfile.TemporaryDirectory() as folder:
                files = {name: Path(folder, f"{name}.pem") for name in ("ssl_certfile", "ssl_keyfile")}
                for path, pem in zip(files.values(), self.tls):
                    path.write_bytes(pem)
                config = _config(self.app, **{name: str(path) for name, path in files.items()})
        else:
            config = _config(self.app)
        self.server = _InLoopServer(config)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises why it could not start
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        self.api.draining = True
        if self.server and self.task:
            self.server.should_exit = True
            await self.task


def _config(app, **tls_files) -> uvicorn.Config:
    traced = tracing.traced_asgi(app, untraced="/health,/metrics")  # a request's trace starts here, when on
    config = uvicorn.Config(
        traced, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5, **tls_files
    )
    config.load()  # reads the TLS files now
    return config


class _InLoopServer(uvicorn.Server):
    """The orchestrator owns SIGINT/SIGTERM (serve_until_signal): uvicorn must not take them."""

    def capture_signals(self):
        return nullcontext()


# -- translation helpers -------------------------------------------------------------------------


def usage(call: Call, finished: dict[int, Finished]) -> dict:
    """Over the choices (index -> its Finished): each prompt's tokens once, as OpenAI and vLLM count
    them, and every choice's output."""
    prompts = {call.choices[index].prompt: done.prompt_tokens for index, done in finished.items()}
    prompt_tokens = sum(prompts.values())
    completion_tokens = sum(done.completion_tokens for done in finished.values())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _failed(failed: Failed) -> ApiError:
    if failed.retry_after_s is not None:
        return Refused(f"{failed.code}: {failed.message}", failed.code, failed.retry_after_s)
    return ApiError(STATUS_OF_CODE.get(failed.code, 500), f"{failed.code}: {failed.message}", code=failed.code)


class Refused(ApiError):
    """A request refused for load (429) or while draining (503), with `Retry-After`: the whole seconds
    after which a retry may find room (worker.py RETRY_AFTER_S), as OpenAI's SDK reads it."""

    def __init__(self, message: str, code: str, retry_after_s: float):
        super().__init__(STATUS_OF_CODE.get(code, 429), message, code=code)
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        response = super().response()
        response.headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return response


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
