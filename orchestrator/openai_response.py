"""Shaping OpenAI answers: a choice's text and log-probabilities, as /v1/completions and
/v1/chat/completions spell them (and vLLM serves them).

The log-probabilities are the target's own at each position: log_softmax of its raw logits at
temperature 1, before penalties, bias, temperature and top-p/top-k (vLLM's default raw logprobs).
Completions (`logprobs: N`, 0..5): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
each top_logprobs entry a {token text: log p} of the N most likely tokens plus the chosen one (as
OpenAI: up to N + 1); an echoed prompt's first token has null for both. Chat (`logprobs: true`,
`top_logprobs: N`, 0..20): `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
"""

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from specd.orchestrator.generation import TopLogprobs


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
