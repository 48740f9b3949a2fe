"""What a load test sends and what it gets back: the prompt files, the settings every request asks
for (`Settings`), and the record of one request as the client saw it (`RequestResult`), which the
targets (grpc_target.py, openai_client.py) fill and the figures (loadtest_stats.py) read.

A prompts file is JSON lines, `{"prompt": ..., "kind": ...}`: the default `prompts.jsonl` mixes
code, docstrings, prose and chat, `prose.jsonl` is an LLMPerf-style prose workload of sonnet lines,
`long.jsonl` ~1,000-token code prompts. Requests take the prompts in turn.

The shared-prefix workload (`--shared-prefixes N`, issue 39: many users over a few system prompts):
each request's prompt opens with one of N shared contexts of ~1,000 tokens (`shared_contexts`),
picked by a hash of the seed and the request's number (the same sequence for every target, and no
cycle that round-robin routing could fall in step with), then its own line and a prompt in turn.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from specd.v1 import specdecode_pb2

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
PROSE_PROMPTS = Path(__file__).resolve().parent / "prose.jsonl"  # LLMPerf-style: sonnet lines to stream on
LONG_PROMPTS = Path(__file__).resolve().parent / "long.jsonl"  # ~1,000-token code prompts (Python stdlib, PSF)


class PromptsError(ValueError):
    """The prompts file is missing or malformed."""


@dataclass
class Settings:
    """What every request of a load test asks for, and where it goes."""

    server: str
    prompts: list[str]
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    draft_tokens: int | None = None  # None: the server's default K; 0: speculation off
    drafter: str = ""  # "": the server's default drafter
    ignore_eos: bool = True
    timeout: float = 600.0
    # Where every prompt is opened by a line of its own (`--unique-prompts`): the run's tag, new for
    # each run and each target's warm-up, hashed with the request's number, so no two prompts of the
    # load test share more than the comment mark and a few hex digits, and no server can answer
    # one from its prefix cache. "": off.
    unique_tag: str = ""
    shared_prefixes: tuple[str, ...] = ()  # contexts the prompts open with, one picked per request (or none)

    def prompt(self, index: int) -> str:
        """Request number `index`'s prompt: the prompts in turn, opened by `# <hex>` where unique,
        after one of the shared contexts where there are some."""
        prompt = self.prompts[index % len(self.prompts)]
        if self.unique_tag:
            line = hashlib.blake2b(f"{self.unique_tag}-{index}".encode(), digest_size=6).hexdigest()
            prompt = f"# {line}\n{prompt}"
        if self.shared_prefixes:
            pick = hashlib.blake2b(f"{self.seed}-{index}".encode(), digest_size=4).digest()
            prompt = self.shared_prefixes[int.from_bytes(pick) % len(self.shared_prefixes)] + prompt
        return prompt


@dataclass
class RequestResult:
    """One Generate call as the client saw it (perf_counter seconds)."""

    started: float
    ended: float = 0.0
    delta_times: list[float] = field(default_factory=list)  # arrival of each delta that carried tokens
    delta_tokens: list[int] = field(default_factory=list)  # tokens each of those deltas carried
    completion_tokens: int = 0
    stats: specdecode_pb2.SpeculationStats | None = None
    error: str | None = None  # gRPC status code name, or the exception's class name
    index: int = 0  # the request's number in its run (its prompt and seed)
    text: str = ""  # the completion's text
    prompt_tokens: int | None = None  # as the server counted them (None: not reported)
    cached_prompt_tokens: int | None = None  # of those, served from the server's prefix cache (None: not said)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e(self) -> float:
        return self.ended - self.started

    @property
    def ttft(self) -> float | None:
        return self.delta_times[0] - self.started if self.delta_times else None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def load_prompts(path: Path | str = DEFAULT_PROMPTS) -> list[str]:
    """The `prompt` of every line of a JSON-lines file, in order."""
    path = Path(path)
    if not path.is_file():
        raise PromptsError(f"prompts file {path} not found (give one with --prompts FILE.jsonl)")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            prompts.append(_prompt_of(line, path, number))
    if not prompts:
        raise PromptsError(f"prompts file {path} holds no prompts")
    return prompts


def shared_contexts(count: int) -> tuple[str, ...]:
    """`count` shared contexts of ~1,000 tokens: the long prompts in turn, each under a first line of
    its own (so no two share a prefix block, whichever long prompt they carry)."""
    long = load_prompts(LONG_PROMPTS) if count else []
    return tuple(
        f"# Shared context {number}: the module below, then a question about it.\n{long[number % len(long)]}\n"
        for number in range(count)
    )


def _prompt_of(line: str, path: Path, number: int) -> str:
    try:
        prompt = json.loads(line)["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise PromptsError(f'{path}:{number}: expected a JSON object with a "prompt" string ({error})') from error
    if not isinstance(prompt, str) or not prompt:
        raise PromptsError(f'{path}:{number}: "prompt" must be a non-empty string')
    return prompt
