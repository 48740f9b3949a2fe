"""An OpenAI request read against the served model: a Call of Choices, each a specd.v1
GenerateRequest for the core.

openai_request.py checks the body's fields one by one; here they meet what this server serves: the
model's name, the target's chat template and vocabulary, the tokens a session may hold. `n` choices
per prompt and a list of prompts (completions) become one Choice each, choice index = prompt × n +
choice, each with a seed of its own: a given `seed` + the choice's number, or a fresh one the core
draws.
"""

import time
import uuid
from dataclasses import dataclass, field

from jinja2 import TemplateError

from specd.orchestrator.core import Core
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
from specd.v1 import specdecode_pb2

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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


class CallParser:
    """Reads request bodies into Calls for one served model (its name, chat template and vocabulary)."""

    def __init__(self, core: Core, model_name: str):
        self.core = core
        self.model_name = model_name
        config = core.tokenizer_config
        self.chat_template = compile_chat_template(config.get("chat_template"))
        self.special_tokens = {name: token_text(config.get(name)) for name in ("bos_token", "eos_token")}

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
        message = specdecode_pb2.GenerateRequest(
            ignore_eos=typed_field(body, "ignore_eos", bool, False),
            cache_salt=typed_field(body, "cache_salt", str, ""),  # its length: the core's check
        )
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
