"""Reading an OpenAI request body: the fields specd takes, those it refuses, and their checks.

Every refusal is an ApiError naming the field, answered as OpenAI's error body (HTTP 400).
"""

import json

from fastapi.responses import JSONResponse
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specd.orchestrator.ahead import DRAFT_AHEAD_MODES
from specd.orchestrator.lookup import DRAFTERS
from specd.proto.limits import penalty_problem
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
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",  # vLLM's extension
    "logit_bias",
    "n",
    "logprobs",
    "specd",
    "cache_salt",  # vLLM's: the tenant's prefix-cache salt (GenerateRequest.cache_salt)
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
MAX_CHOICES = 16  # n x prompts of one request: each is a session of its own on both services
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on /v1/completions' `logprobs`
MAX_CHAT_TOP_LOGPROBS = 20  # and on /v1/chat/completions' `top_logprobs`

# OpenAI's chat roles, less those of tool calling (`tool`, `function`), which specd does not do.
ROLES = ("system", "user", "assistant", "developer")
UINT32 = 2**32  # top_k travels as a uint32 (common.proto)
FLOAT32_MAX = 3.4028234663852886e38  # temperature and top_p travel as float32
FLOAT32_TINY = 1.5e-45  # rounds to float32's smallest positive value, not to 0
KINDS = {str: "a string", bool: "true or false", dict: "an object"}  # as typed_field's message says them

# OpenAI fields specd does not implement: accepted only at their default value.
UNSUPPORTED = {
    "best_of": ((1,), "specd generates only the choices it returns (`n`)"),
    "suffix": (("",), "insertion (suffix) is not supported"),
    "tools": (([],), "tool calling is not supported"),
    "tool_choice": (("none",), "tool calling is not supported"),
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
    "response_format": (({"type": "text"},), "structured output (response_format) is not supported"),
}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        message, param = _printable(message), param and _printable(param)  # JSON answers are UTF-8
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


def valid_unicode(body) -> None:
    """Refuse a lone surrogate in any string of the body, value or field name: JSON's "\\ud800" (or a
    UTF-16 body) parses into one, but it is no character, and no UTF-8 carries it to the tokenizer.
    (gRPC cannot carry one either: proto strings are UTF-8, and the servers refuse what is not.)"""
    pending = [(body, None)]  # (value, its path: (the parent's path, its name or index)); no recursion
    while pending:  # in document order: the first bad string is the one named
        value, path = pending.pop()
        if isinstance(value, dict):
            for name in value:
                _no_surrogate(name, (path, name), "the field name ")
            pending.extend((item, (path, name)) for name, item in reversed(value.items()))
        elif isinstance(value, list):
            pending.extend((value[index], (path, index)) for index in reversed(range(len(value))))
        elif isinstance(value, str):
            _no_surrogate(value, path)


def _no_surrogate(text: str, path, what: str = "") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        steps = []
        while path is not None:
            path, step = path
            steps.append(f"[{step}]" if isinstance(step, int) else f".{step}")
        where = "".join(reversed(steps)).lstrip(".")
        message = f"{what}`{where}` is not valid Unicode: it holds a lone surrogate at index {error.start}"
        raise ApiError(400, message, where) from None


def chat_message(entry, index: int) -> dict:
    """One of `messages` as the chat template takes it: a known role and text content."""
    where = f"messages[{index}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("role"), str):
        raise ApiError(400, f"{where} must be an object with a `role`", where)
    for name in entry:
        if name not in ("role", "content", "name"):
            raise ApiError(400, f"{where}.{name} is not supported (no tool calls)", f"{where}.{name}")
    role = entry["role"]
    if role not in ROLES:
        why = "is not supported (no tool calls)" if role in ("tool", "function") else "is not a chat role"
        raise ApiError(400, f"`{where}.role` = {shown(role)} {why}: use {', '.join(ROLES)}", f"{where}.role")
    if not isinstance(entry.get("name", ""), str | None):
        raise ApiError(400, f"`{where}.name` must be a string, got {shown(entry['name'])}", f"{where}.name")
    # OpenAI reads `developer` as `system` on models older than the role; open models' templates
    # (Qwen2.5's) know no `developer` and would drop the message without a word.
    return {"role": "system" if role == "developer" else role, "content": text_content(entry.get("content", ""), index)}


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "`stop` must be a non-empty string or a list of them", "stop")
    return stop


def extension(body: dict, max_k: int) -> tuple[int | None, str, str, bool]:
    """`"specd": {"draft_tokens": K, "drafter": name, "draft_ahead": mode, "trace": bool}` -> (K or None
    for the server's default, the drafter and the draft-ahead mode or "" for the server's, trace);
    `max_k`: the largest K the services take."""
    extension = typed_field(body, "specd", dict, {})
    for name in extension:
        if name not in ("draft_tokens", "drafter", "draft_ahead", "trace"):
            raise ApiError(
                400,
                f"unknown field `specd.{name}`; the extension takes `draft_tokens` (K, 0 = off), "
                f"`drafter` ({' | '.join(DRAFTERS)}), `draft_ahead` ({' | '.join(DRAFT_AHEAD_MODES)}) and `trace`",
                f"specd.{name}",
            )
    named = {}
    for name, allowed in (("drafter", DRAFTERS), ("draft_ahead", DRAFT_AHEAD_MODES)):
        named[name] = extension.get(name, "")
        if named[name] != "" and named[name] not in allowed:
            raise ApiError(
                400, f"`specd.{name}` must be one of {', '.join(allowed)}, got {shown(named[name])}", f"specd.{name}"
            )
    k = extension.get("draft_tokens")
    if k is not None and (not is_int(k) or k < 0):
        raise ApiError(400, f"`specd.draft_tokens` must be an integer >= 0, got {shown(k)}", "specd.draft_tokens")
    if k is not None and k > max_k:
        raise ApiError(
            400,
            f"`specd.draft_tokens` K={shown(k)} is above the largest the services accept ({max_k}); "
            "0 turns speculation off",
            "specd.draft_tokens",
        )
    trace = extension.get("trace", False)
    if not isinstance(trace, bool):
        raise ApiError(400, f"`specd.trace` must be true or false, got {shown(trace)}", "specd.trace")
    return k, named["drafter"], named["draft_ahead"], trace


def streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = typed_field(body, "stream", bool, False)
    options = typed_field(body, "stream_options", dict, {})
    if options and not stream:
        raise ApiError(400, "`stream_options` needs `stream: true`", "stream_options")
    if set(options) - {"include_usage"}:
        raise ApiError(400, "`stream_options` takes only `include_usage`", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(
            400, f"`stream_options.include_usage` must be true or false, got {shown(include_usage)}", "stream_options"
        )
    return stream, include_usage


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
    top_p = max(top_p, FLOAT32_TINY)  # not 0 as a float32, which means 1 (off)
    top_k = body.get("top_k", 0)
    if not is_int(top_k) or not -1 <= top_k < UINT32:
        raise ApiError(400, f"`top_k` must be an integer in [-1, 2^32) (0 or -1: off), got {shown(top_k)}", "top_k")
    seed = body.get("seed")  # None: unset, the core draws one per choice
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**64):
        raise ApiError(400, f"`seed` must be an integer in [0, 2^64), got {shown(seed)}", "seed")
    return common_pb2.SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(0, top_k), seed=seed, **penalties(body)
    )


def choices_per_prompt(body: dict, prompts: int) -> int:
    """`n`, with n x prompts at most MAX_CHOICES."""
    n = body.get("n", 1)
    if not is_int(n) or n < 1:
        raise ApiError(400, f"`n` must be an integer >= 1, got {shown(n)}", "n")
    if n * prompts > MAX_CHOICES:
        several = f" x {prompts} prompts" if prompts > 1 else ""
        raise ApiError(
            400, f"`n` = {n}{several} asks for {n * prompts} choices, specd returns at most {MAX_CHOICES}", "n"
        )
    return n


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """None: no log-probabilities; else how many alternatives per position. Completions: `logprobs`
    0..5; chat: `logprobs: true` and `top_logprobs` 0..20 (which needs it)."""
    if not chat:
        asked = body.get("logprobs")
        if asked is False:  # not OpenAI's type (an integer or null), but what clients send for "none"
            return None
        if asked is not None and (not is_int(asked) or not 0 <= asked <= MAX_COMPLETION_LOGPROBS):
            raise ApiError(
                400, f"`logprobs` must be an integer in 0..{MAX_COMPLETION_LOGPROBS}, got {shown(asked)}", "logprobs"
            )
        return asked
    asked = typed_field(body, "logprobs", bool, False)
    top = body.get("top_logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS):
        raise ApiError(
            400, f"`top_logprobs` must be an integer in 0..{MAX_CHAT_TOP_LOGPROBS}, got {shown(top)}", "top_logprobs"
        )
    if top is not None and not asked:
        raise ApiError(400, "`top_logprobs` needs `logprobs: true`", "top_logprobs")
    return (top or 0) if asked else None


def penalties(body: dict) -> dict:
    """presence_penalty, frequency_penalty, repetition_penalty (vLLM's extension) and logit_bias as
    SamplingParams fields, checked against OpenAI's bounds (proto/limits.py penalty_problem); the token
    ids of logit_bias against the vocabulary in the core. They apply when greedy too."""
    presence, frequency = _number(body, "presence_penalty", 0.0), _number(body, "frequency_penalty", 0.0)
    repetition = _number(body, "repetition_penalty", 1.0)
    logit_bias = typed_field(body, "logit_bias", dict, {})
    biases = {}
    for key, bias in logit_bias.items():
        token = int(key) if key.isascii() and key.isdecimal() else None
        if token is None or token >= UINT32:
            raise ApiError(400, f"`logit_bias` keys must be token ids (integers >= 0), got {shown(key)}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ApiError(400, f"`logit_bias` of token {token} must be a number, got {shown(bias)}", "logit_bias")
        biases[token] = float(bias)
    problem = penalty_problem(presence, frequency, repetition, biases, None)
    if problem:
        raise ApiError(400, problem[1], problem[0])
    return {
        "presence_penalty": presence,
        "frequency_penalty": frequency,
        "repetition_penalty": repetition,
        "logit_bias": biases,
    }


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= FLOAT32_MAX:
        raise ApiError(400, f"`{name}` must be a finite number (a float32), got {shown(value)}", name)
    return float(value)


def typed_field(body: dict, name: str, kind: type, default):
    value = body.get(name, default)
    if not isinstance(value, kind):
        raise ApiError(400, f"`{name}` must be {KINDS[kind]}, got {shown(value)}", name)
    return value


def shown(value) -> str:
    """A value as JSON for an error message, cut to 80 characters."""
    try:
        text = json.dumps(value)
    except (RecursionError, ValueError):
        text = "(a value nested too deeply to show)"
    return text if len(text) <= 80 else f"{text[:77]}..."


def _printable(text: str) -> str:
    """`text` with any lone surrogate spelled out (\\ud800): UTF-8 cannot encode one."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
