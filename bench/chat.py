"""The multi-turn chat workload of `specd loadtest --chat`: N conversations of T turns, C at once.

A conversations file is JSON lines in the style of ShareGPT's multi-turn sets, one conversation a line:
`{"id": ..., "conversations": [{"from": "system", "value": ...}, {"from": "human", "value": ...}, ...]}`.
Only the human turns (and an optional system prompt, else Qwen2.5's default) are read: the answers
are the ones the server under test gives (a "gpt" turn in the file is skipped). `chat.jsonl` ships
16 conversations of 6 human turns, about 150 tokens each, of code help and prose.

Turn t of a conversation sends the whole history so far, the system prompt, every earlier human message
and the answer the server actually gave to it, plus the t-th human message, as one plain-text prompt
in the Qwen2.5 chat format (`render_prompt`), so a gRPC target (specd's Generate) and an OpenAI-
compatible one (streamed /v1/completions) receive the very same text, and turn t's prompt is a prefix
of turn t+1's: what a prefix cache can reuse. A conversation's turns run in order; C conversations
run at once, each worker taking the next conversation when its last one ends (closed loop). Several
targets run one after another, each the whole workload, in the order given, after `warmup` short
requests of their own (a prompt unrelated to the chat, so that no prefix of it is cached).

Per target (one entry of the report's `runs`, `summarize_chat`) and per turn number (`turn_figures`):
TTFT (mean/p50/p90/p99), end-to-end latency, a stream's tokens/s (completion tokens / seconds over
the turn's requests), the prompt tokens, the prompt tokens served from cache where the server says
so (specd's Final stats `cached_prompt_tokens`, OpenAI `usage.prompt_tokens_details.cached_tokens`,
llama-server's `timings.cache_n`; None: unknown) and their ratio, the hit rate. The cache hit rate
of a target is over turns 2..T (turn 1 has no history of its own). `outputs` holds every completion's
text per conversation and turn, and `outputs_match` compares each target's with the first target's,
turn by turn (greedy: a cache must not change a single token). A failed turn ends its conversation:
the turns after it are not sent.
"""

import asyncio
import contextlib
import itertools
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specd.bench.loadtest import machine_info
from specd.bench.loadtest_stats import percentiles, speculation_summary
from specd.bench.workload import RequestResult, Settings

DEFAULT_CHAT = Path(__file__).resolve().parent / "chat.jsonl"
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."  # Qwen2.5's own default
WARMUP_PROMPT = "def fibonacci(n):\n"  # no prefix in common with a chat prompt
WARMUP_TOKENS = 16
HUMAN, SYSTEM = ("human", "user"), ("system",)  # ShareGPT's roles and OpenAI's names for them

ProgressHook = Callable[[str, int], Callable[[], None]]


class ChatError(ValueError):
    """The conversations file is missing or malformed, or holds fewer conversations or turns than asked."""


@dataclass(frozen=True)
class Conversation:
    id: str
    system: str
    turns: tuple[str, ...]  # the human messages, in order


@dataclass
class Turn:
    """One request of the chat workload: turn `turn` (1-based) of conversation `conversation` (0-based)."""

    conversation: int
    turn: int
    result: RequestResult


def load_conversations(path: Path | str = DEFAULT_CHAT) -> list[Conversation]:
    """Every conversation of a ShareGPT-style JSON-lines file, in order."""
    path = Path(path)
    if not path.is_file():
        raise ChatError(f"conversations file {path} not found (give one with --chat FILE.jsonl)")
    conversations = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            conversations.append(_conversation_of(line, f"{path}:{number}", len(conversations)))
    if not conversations:
        raise ChatError(f"conversations file {path} holds no conversations")
    return conversations


def _conversation_of(line: str, where: str, index: int) -> Conversation:
    try:
        record = json.loads(line)
        messages = [(message["from"], message["value"]) for message in record["conversations"]]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ChatError(
            f'{where}: expected {{"conversations": [{{"from": ..., "value": ...}}, ...]}} ({error})'
        ) from None
    if not all(isinstance(value, str) and value for _, value in messages):
        raise ChatError(f'{where}: every "value" must be a non-empty string')
    turns = tuple(value for role, value in messages if role in HUMAN)
    if not turns:
        raise ChatError(f'{where}: no human turn ("from": "human")')
    system = next((value for role, value in messages if role in SYSTEM), record.get("system") or DEFAULT_SYSTEM)
    return Conversation(str(record.get("id", index)), system, turns)


def pick_conversations(conversations: list[Conversation], count: int, turns: int) -> list[Conversation]:
    """The first `count` conversations, each of at least `turns` human turns (a ChatError otherwise: a
    conversation sent twice would find its own prefixes cached)."""
    if count > len(conversations):
        raise ChatError(f"{count} conversations asked for, the file holds {len(conversations)}")
    short = [c.id for c in conversations[:count] if len(c.turns) < turns]
    if short:
        raise ChatError(f"{turns} turns asked for: conversation(s) {', '.join(short)} have fewer human turns")
    return conversations[:count]


def render_prompt(system: str, exchanges: list[tuple[str, str]], message: str) -> str:
    """The chat so far and the next human message as one text in the Qwen2.5 chat format, the assistant's
    turn left open: `exchanges` are the earlier (human message, answer the server gave) pairs."""
    parts = [f"<|im_start|>system\n{system}<|im_end|>\n"]
    for human, answer in exchanges:
        parts.append(f"<|im_start|>user\n{human}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")
    parts.append(f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n")
    return "".join(parts)


async def converse(
    target, settings: Settings, conversation: Conversation, index: int, turns: int, advance=lambda: None
) -> list[Turn]:
    """The conversation's first `turns` turns in order, each with the answers given so far; stops at a failure."""
    exchanges, done = [], []
    for number, message in enumerate(conversation.turns[:turns], 1):
        prompt = render_prompt(conversation.system, exchanges, message)
        seed = settings.seed + index * turns + number - 1
        result = await target.send(replace(settings, prompts=[prompt], seed=seed), 0)
        result.index = index * turns + number - 1
        done.append(Turn(index, number, result))
        advance()
        if not result.ok:
            for _ in range(turns - number):  # not sent: the progress still reaches its total
                advance()
            break
        exchanges.append((message, result.text))
    return done


async def chat_loop(
    target, settings: Settings, conversations: list[Conversation], turns: int, concurrency: int, advance=lambda: None
) -> tuple[list[Turn], float]:
    """`concurrency` workers, each running the next conversation when its last one ends: (turns, wall seconds)."""
    indices, done = itertools.count(), []

    async def worker() -> None:
        while (index := next(indices)) < len(conversations):
            done.extend(await converse(target, settings, conversations[index], index, turns, advance))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(done, key=lambda t: (t.conversation, t.turn)), time.perf_counter() - started


async def run_chat(
    settings: Settings,
    conversations: list[Conversation],
    turns: int,
    concurrency: int,
    targets: list,
    progress: ProgressHook | None = None,
    warmup: int = 2,
    chat_file: str | None = None,
) -> dict:
    """The chat workload against each target in turn: {"runs": [...], "outputs_match": [...], "settings": {...}}."""
    names = [target.name for target in targets]
    if not targets or len(set(names)) < len(names):
        raise ValueError("give one target or more, each once")
    runs = []
    async with contextlib.AsyncExitStack() as stack:
        for target in targets:
            await target.open(settings.timeout)
            stack.push_async_callback(target.close)
        for target in targets:
            warm = replace(
                settings, prompts=[WARMUP_PROMPT], max_new_tokens=min(settings.max_new_tokens, WARMUP_TOKENS)
            )
            for number in range(warmup):  # not measured
                await target.send(replace(warm, seed=settings.seed + number), 0)
            label = f"chat C={concurrency}" + (f" {target.name}" if len(targets) > 1 else "")
            advance = progress(label, len(conversations) * turns) if progress else (lambda: None)
            done, wall = await chat_loop(target, settings, conversations, turns, concurrency, advance)
            run = summarize_chat(done, wall, conversations, turns, concurrency, target.speculation)
            runs.append({"target": target.name, "backend": target.backend, **run})
    record = asdict(settings)
    del record["prompts"], record["server"]
    return {
        "workload": "chat",
        "runs": runs,
        "outputs_match": outputs_match(runs),
        "settings": {
            **record,
            "chat_file": chat_file,
            "conversations": len(conversations),
            "conversation_ids": [c.id for c in conversations],
            "turns": turns,
            "concurrency": concurrency,
            "warmup_requests": warmup,
            "prompt_format": "qwen2.5 chat, as text",
            "targets": [target.describe() for target in targets],
            "server_info": next((t.info for t in targets if t.backend == "grpc"), None),
            "machine": machine_info(),  # the load tester's CPU
        },
    }


def summarize_chat(
    done: list[Turn], wall: float, conversations: list[Conversation], turns: int, concurrency: int, speculation: bool
) -> dict:
    """One target's figures: the run's, per turn number (`per_turn`), turns 2..T together, the outputs."""
    results = [t.result for t in done]
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    later = turn_figures([t.result for t in done if t.turn >= 2])
    texts = [[None] * turns for _ in conversations]
    for t in done:
        texts[t.conversation][t.turn - 1] = t.result.text if t.result.ok else None
    figures = {
        "concurrency": concurrency,
        "conversations": len(conversations),
        "turns": turns,
        "requests": len(results),
        "not_sent": len(conversations) * turns - len(results),
        "completed": len(ok),
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "later_turns": later,  # turns 2..T together
        "cache_hit_rate": later["cache_hit_rate"],
        "per_turn": [{"turn": n, **turn_figures([t.result for t in done if t.turn == n])} for n in range(1, turns + 1)],
        "errors": dict(sorted(Counter(r.error for r in results if not r.ok).items())),
        "outputs": [{"id": c.id, "turns": texts[i]} for i, c in enumerate(conversations)],
        "per_request": [_request_record(t, conversations) for t in done],
    }
    if speculation:
        stats = [r.stats for r in ok if r.stats is not None]
        summary = speculation_summary(stats)
        figures |= {key: summary[key] for key in ("acceptance_rate", "mean_accepted_length", "mean_draft_length")}
    return figures


def turn_figures(results: list[RequestResult]) -> dict:
    """The figures of some requests (one turn number's): TTFT, e2e, a stream's tokens/s, prompt and cached tokens."""
    ok = [r for r in results if r.ok]
    seconds = sum(r.e2e for r in ok)
    tokens = sum(r.completion_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    reported = [r for r in ok if r.cached_prompt_tokens is not None]
    cached = sum(r.cached_prompt_tokens for r in reported)
    counted = sum(r.prompt_tokens for r in reported if r.prompt_tokens)
    return {
        "requests": len(results),
        "completed": len(ok),
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "output_tokens": tokens,
        "stream_tokens_per_s": tokens / seconds if seconds > 0 else None,  # Σ completion tokens / Σ e2e
        "prompt_tokens": sum(prompts) if prompts else None,
        "prompt_tokens_mean": sum(prompts) / len(prompts) if prompts else None,
        "cached_prompt_tokens": cached if reported else None,  # None: no request's server said
        "cache_reported": len(reported),
        "cache_hit_rate": cached / counted if counted else None,  # over the requests that said both
        "errors": dict(sorted(Counter(r.error for r in results if not r.ok).items())),
    }


def outputs_match(runs: list[dict]) -> list[dict]:
    """Each target's outputs against the first target's, turn by turn (turns both completed)."""
    if not runs:
        return []
    reference, entries = runs[0], []
    for run in runs[1:]:
        compared = equal = 0
        first = None
        for mine, theirs in zip(run["outputs"], reference["outputs"]):
            for number, (a, b) in enumerate(zip(mine["turns"], theirs["turns"]), 1):
                if a is None or b is None:
                    continue
                compared += 1
                equal += a == b
                if a != b and first is None:
                    first = {"conversation": mine["id"], "turn": number}
        entries.append(
            {
                "target": run["target"],
                "reference": reference["target"],
                "turns_compared": compared,
                "turns_equal": equal,
                "identical": compared > 0 and compared == equal,
                "first_difference": first,
            }
        )
    return entries


def _request_record(turn: Turn, conversations: list[Conversation]) -> dict:
    r = turn.result
    return {
        "conversation": conversations[turn.conversation].id,
        "turn": turn.turn,
        "ttft_s": r.ttft,
        "e2e_s": r.e2e,
        "prompt_tokens": r.prompt_tokens,
        "cached_prompt_tokens": r.cached_prompt_tokens,
        "completion_tokens": r.completion_tokens if r.ok else 0,
        "error": r.error,
    }
