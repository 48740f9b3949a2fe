"""Reading an OpenAI request body: the fields specd takes, those it refuses, and their checks.

Every refusal is an ApiError naming the field, answered as OpenAI's error body (HTTP 400).
"""

import json

from fastapi.responses import JSONResponse
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specd.v1 import common_pb2

# Fields both endpoints take; then each endpoint's own.
COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "user",
    "ignore_eos",
    "specd",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}

# OpenAI fields specd does not implement: accepted only at their default value.
UNSUPPORTED = {
    "n": ((1,), "specd returns one choice per request; send n requests instead"),
    "best_of": ((1,), "specd returns one choice per request"),
    "echo": ((False,), "the prompt is not echoed back"),
    "suffix": (("",), "insertion (suffix) is not supported"),
    "logprobs": ((False, 0), "log probabilities are not returned"),
    "top_logprobs": ((0,), "log probabilities are not returned"),
    "presence_penalty": ((0,), "penalties would change the target's distribution, which speculation keeps exact"),
    "frequency_penalty": ((0,), "penalties would change the target's distribution, which speculation keeps exact"),
    "logit_bias": (({},), "logit_bias would change the target's distribution, which speculation keeps exact"),
    "tools": (([],), "tool calling is not supported"),
    "tool_choice": (("none",), "tool calling is not supported"),
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
    "response_format": (({"type": "text"},), "structured output (response_format) is not supported"),
}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def compile_chat_template(source: str | None):
    """Compile a Hugging Face chat template the way transformers does (sandboxed Jinja)."""
    if isinstance(source, list):  # older configs: [{"name": "default", "template": ...}, ...]
        source = next((entry.get("template") for entry in source if entry.get("name") == "default"), None)
    if not source:
        return None
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)

    def raise_exception(message):
        raise ApiError(400, f"the chat template refused the messages: {message}", "messages")

    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "`stop` must be a non-empty string or a list of them", "stop")
    return stop


def extension(body: dict) -> tuple[int | None, bool]:
    """`"specd": {"draft_tokens": K, "trace": bool}` -> (K or None for the server's default, trace)."""
    extension = typed_field(body, "specd", dict, {})
    for name in extension:
        if name not in ("draft_tokens", "trace"):
            raise ApiError(
                400,
                f"unknown field `specd.{name}`; the extension takes `draft_tokens` (K, 0 = off) and `trace`",
                f"specd.{name}",
            )
    k = extension.get("draft_tokens")
    if k is not None and (not is_int(k) or k < 0):
        raise ApiError(400, f"`specd.draft_tokens` must be an integer >= 0, got {json.dumps(k)}", "specd.draft_tokens")
    trace = extension.get("trace", False)
    if not isinstance(trace, bool):
        raise ApiError(400, f"`specd.trace` must be true or false, got {json.dumps(trace)}", "specd.trace")
    return k, trace


def streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = typed_field(body, "stream", bool, False)
    options = typed_field(body, "stream_options", dict, {})
    if options and not stream:
        raise ApiError(400, "`stream_options` needs `stream: true`", "stream_options")
    if set(options) - {"include_usage"}:
        raise ApiError(400, "`stream_options` takes only `include_usage`", "stream_options")
    return stream, bool(options.get("include_usage", False))


def text_content(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise ApiError(
        400,
        f"messages[{index}].content must be a string or a list of text parts (no images or audio)",
        f"messages[{index}].content",
    )


def token_text(token) -> str:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    return token.get("content", "") if isinstance(token, dict) else token or ""


def sampling_params(body: dict) -> common_pb2.SamplingParams:
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise ApiError(400, f"`temperature` must be >= 0, got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"`top_p` must be in (0, 1], got {top_p}", "top_p")
    top_k = body.get("top_k", 0)
    if not is_int(top_k) or top_k < -1:
        raise ApiError(400, f"`top_k` must be an integer >= 0 (0 or -1: off), got {json.dumps(top_k)}", "top_k")
    seed = body.get("seed", 0)
    if not is_int(seed) or not 0 <= seed < 2**64:
        raise ApiError(400, f"`seed` must be an integer in [0, 2^64), got {json.dumps(seed)}", "seed")
    return common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=max(0, top_k), seed=seed)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise ApiError(400, f"`{name}` must be a finite number, got {json.dumps(value)}", name)
    return float(value)


def typed_field(body: dict, name: str, kind: type, default):
    value = body.get(name, default)
    if not isinstance(value, kind):
        raise ApiError(400, f"`{name}` must be a {kind.__name__}, got {json.dumps(value)}", name)
    return value


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
