"""A streamed completion (`"stream": true`): its choices' events as server-sent events, in the
chunks OpenAI's streaming API sends (`chat.completion.chunk`, or `text_completion` pieces), then
`data: [DONE]`. Each choice's last chunk carries its finish reason, its seed and its stats.
"""

import asyncio
import json
from contextlib import aclosing

from fastapi.responses import StreamingResponse
from tokenizers import Tokenizer

from specd.orchestrator.core import stats_dict
from specd.orchestrator.openai_call import Call
from specd.orchestrator.openai_response import LogprobsFormat, Scored, api_error, prompt_scored, usage
from specd.orchestrator.request import Delta, Failed


class Stream:
    """One streamed Call: the server-sent events of its choices."""

    def __init__(self, call: Call, model_name: str, tokenizer: Tokenizer):
        self.call = call
        self.model_name = model_name
        self.tokenizer = tokenizer

    async def response(self, runs: list) -> StreamingResponse:
        """The response over each choice's events; each choice's first event is awaited before it
        starts, so an error that ends a request before any output still gets its own HTTP status."""
        firsts = await asyncio.gather(*(anext(events) for events in runs))
        failed = next((first for first in firsts if isinstance(first, Failed)), None)
        if failed:
            for events in runs:
                await events.aclose()
            raise api_error(failed)
        return StreamingResponse(
            self.events(list(zip(firsts, runs))),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def events(self, runs: list):
        """The stream's chunks: per choice (chat: the role,) (the echoed prompt,) text deltas, the
        finish with its seed and stats; then (usage,) [DONE]. The choices' chunks interleave as they
        come. A client that leaves cancels every choice: their generation loops stop."""
        call = self.call
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, first, events) -> None:
            event = first
            async with aclosing(events):
                while event is not None:
                    await queue.put((index, event))
                    event = await anext(events, None)
            await queue.put((index, None))

        pumps = [asyncio.create_task(pump(index, *run)) for index, run in enumerate(runs)]
        formats = [LogprobsFormat(self.tokenizer, call.chat, call.logprobs or 0) for _ in runs]
        started, finished, running, failed = set(), {}, len(runs), False
        try:
            if call.chat:
                for index in range(len(runs)):
                    yield _event(self.chunk(index, {"role": "assistant", "content": ""}))
            while running and not failed:
                index, event = await queue.get()
                if event is None:
                    running -= 1
                elif isinstance(event, Failed):
                    yield _event(api_error(event).body())
                    failed = True  # the others stop too (finally)
                elif isinstance(event, Delta):
                    if index not in started:
                        started.add(index)
                        chunk = self.echo_chunk(index, event, formats[index])
                        if chunk:
                            yield _event(chunk)
                    if event.text or (call.logprobs is not None and event.token_ids):
                        chunk = self.chunk(index, {"content": event.text} if call.chat else event.text)
                        if call.logprobs is not None:
                            scored = Scored()
                            scored.add(event.token_ids, event.logprobs, event.top_logprobs)
                            chunk["choices"][0]["logprobs"] = formats[index].format(scored)
                        yield _event(chunk)
                else:
                    finished[index] = event
                    last = self.chunk(index, {} if call.chat else "", event.reason)
                    last["choices"][0]["seed"] = event.seed
                    last["specd"] = stats_dict(event.stats, steps=call.trace)
                    yield _event(last)
            if call.include_usage and not failed:
                yield _event({**self.chunk(0, None), "choices": [], "usage": usage(call, finished)})
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def echo_chunk(self, index: int, first: Delta, logprobs: LogprobsFormat) -> dict | None:
        """The echoed prompt of a completion choice, before its first tokens (None: not echoed)."""
        call = self.call
        choice = call.choices[index]
        if call.chat or not choice.echo:
            return None
        chunk = self.chunk(index, choice.echo)
        if call.logprobs is not None:
            scored = prompt_scored(choice.echo_ids, first.prompt_logprobs, first.prompt_top_logprobs)
            chunk["choices"][0]["logprobs"] = logprobs.format(scored)
        return chunk

    def chunk(self, index: int, delta, finish: str | None = None) -> dict:
        call = self.call
        choice = {"index": index, "finish_reason": finish, "logprobs": None, ("delta" if call.chat else "text"): delta}
        return {
            "id": call.id,
            "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created,
            "model": self.model_name,
            "choices": [choice],
        }


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
