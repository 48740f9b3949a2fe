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
`top_k`, `ignore_eos`, `cache_salt` (as in vLLM: the tenant's prefix-cache salt) and
`"specd": {"draft_tokens": K, "drafter": "ngram", "draft_ahead": "on", "trace": true}` (K = 0 turns
speculation off; drafter: model, ngram, suffix or hybrid; draft_ahead: auto, on or off, ahead.py;
trace adds each step's draft and verify seconds). Every response (each choice's last chunk, when
streaming) carries the request's speculation stats in `"specd"`, named as the gRPC Final's
SpeculationStats (core.stats_dict); with several choices, each choice carries its own. `usage`
counts each prompt once, with `prompt_tokens_details.cached_tokens`: the prompt tokens the target
took from its prefix cache.

Here: the routes, their token check, and the server (uvicorn in the orchestrator's event loop). A
request is read by openai_request.py (field by field) and openai_call.py (against the served model),
answered by openai_response.py, and streamed by openai_stream.py.
"""

import asyncio
import hmac
import socket
import tempfile
from contextlib import aclosing, nullcontext, suppress
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specd.orchestrator.core import BadRequest, Core, stats_dict
from specd.orchestrator.drain import DRAINING
from specd.orchestrator.openai_call import Call, CallParser
from specd.orchestrator.openai_request import ApiError
from specd.orchestrator.openai_response import LogprobsFormat, Refused, Scored, api_error, prompt_scored, usage
from specd.orchestrator.openai_stream import Stream
from specd.orchestrator.request import RETRY_AFTER_S, Delta, Failed, Finished
from specd.proto import tracing

API_LABEL = "http"  # the `api` label of this API's requests in the metrics
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


class OpenAiApi:
    """Translates OpenAI requests for the core (which owns the pair and the pool) and its answers back."""

    def __init__(self, core: Core, model_name: str | None = None):
        self.core = core
        self.model_name = model_name or core.model_name
        self.parser = CallParser(core, self.model_name)
        self.draining = False

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
                    raise api_error(event)
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
        """Server-sent events (openai_stream.py)."""
        return await Stream(call, self.model_name, self.core.tokenizer).response(self.start(call))

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
            call = api.parser.parse(body, chat)
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
