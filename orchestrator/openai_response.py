"""Shaping OpenAI answers: a choice's log-probabilities, the usage, and the error a request ends with,
as /v1/completions and /v1/chat/completions spell them (and vLLM serves them).

The log-probabilities are the target's own at each position: log_softmax of its raw logits at
temperature 1, before penalties, bias, temperature and top-p/top-k (vLLM's default raw logprobs).
Completions (`logprobs: N`, 0..5): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
each top_logprobs entry a {token text: log p} of the N most likely tokens plus the chosen one (as
OpenAI: up to N + 1); an echoed prompt's first token has null for both. Chat (`logprobs: true`,
`top_logprobs: N`, 0..20): `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.

A request that fails answers its gRPC status code's HTTP status (STATUS_OF_CODE), in OpenAI's error
body; one refused for load or while draining also says when to retry (Retry-After).
"""

import math
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from tokenizers import Tokenizer

from specd.orchestrator.openai_call import Call
from specd.orchestrator.openai_request import ApiError
from specd.orchestrator.request import Failed, Finished, TopLogprobs

STATUS_OF_CODE = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


@dataclass
class Scored:
    """Tokens with their log-probabilities (None: not scored, an echoed prompt's first token)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[tuple[list[int], list[float]] | None] = field(default_factory=list)  # per token; [] entries: none asked

    def add(self, token_ids: list[int], logprobs: list, top: TopLogprobs) -> None:
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.top += top or [([], [])] * len(token_ids)


def prompt_scored(prompt_ids: list[int], logprobs: list[float], top: TopLogprobs) -> Scored:
    """An echoed prompt: its first token has no log-probability (nothing comes before it)."""
    scored = Scored(list(prompt_ids[:1]), [None] * min(1, len(prompt_ids)), [None] * min(1, len(prompt_ids)))
    scored.add(list(prompt_ids[1:]), logprobs, top)
    return scored


class LogprobsFormat:
    """Formats Scored tokens for one choice; keeps the text offset across a stream's chunks."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, top_n: int):
        self.tokenizer = tokenizer
        self.chat = chat
        self.top_n = top_n  # alternatives asked per position
        self.offset = 0  # completions' text_offset of the next token, in characters of the choice's text

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def format(self, scored: Scored) -> dict:
        return self._chat(scored) if self.chat else self._completion(scored)

    def _completion(self, scored: Scored) -> dict:
        tokens = [self.text(token) for token in scored.token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        top_logprobs = []
        for token, logprob, top in zip(tokens, scored.logprobs, scored.top):
            if logprob is None:
                top_logprobs.append(None)
                continue
            ids, values = top
            alternatives = {self.text(i): v for i, v in zip(ids[: self.top_n], values)}
            alternatives.setdefault(token, logprob)  # the chosen token is always there (OpenAI: up to N + 1)
            top_logprobs.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": list(scored.logprobs),
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _chat(self, scored: Scored) -> dict:
        content = []
        for token_id, logprob, (ids, values) in zip(scored.token_ids, scored.logprobs, scored.top):
            entry = self._chat_token(token_id, logprob)
            entry["top_logprobs"] = [self._chat_token(i, v) for i, v in zip(ids[: self.top_n], values)]
            content.append(entry)
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def usage(call: Call, finished: dict[int, Finished]) -> dict:
    """Over the choices (index -> its Finished): each prompt's tokens once, as OpenAI and vLLM count
    them, and every choice's output. `prompt_tokens_details.cached_tokens`: of the prompt tokens, those
    the target took from its prefix cache (each prompt once too: the most any of its choices took)."""
    prompts = {call.choices[index].prompt: done.prompt_tokens for index, done in finished.items()}
    cached: dict[int, int] = {}
    for index, done in finished.items():
        prompt = call.choices[index].prompt
        cached[prompt] = max(cached.get(prompt, 0), done.cached_prompt_tokens)
    prompt_tokens = sum(prompts.values())
    completion_tokens = sum(done.completion_tokens for done in finished.values())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


def api_error(failed: Failed) -> ApiError:
    """The HTTP error of a request that failed (a Failed event)."""
    if failed.retry_after_s is not None:
        return Refused(f"{failed.code}: {failed.message}", failed.code, failed.retry_after_s)
    return ApiError(STATUS_OF_CODE.get(failed.code, 500), f"{failed.code}: {failed.message}", code=failed.code)


class Refused(ApiError):
    """A request refused for load (429) or while draining (503), with `Retry-After`: the whole seconds
    after which a retry may find room (request.py RETRY_AFTER_S), as OpenAI's SDK reads it."""

    def __init__(self, message: str, code: str, retry_after_s: float):
        super().__init__(STATUS_OF_CODE.get(code, 429), message, code=code)
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        response = super().response()
        response.headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return response
