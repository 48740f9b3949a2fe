"""Load-testing harness for `specd.v1.SpecDecode/Generate`.

Two ways to offer load:

- closed loop (`closed_loop`): C workers, each sending its next request as soon as its
  previous one ends, until N requests are done; swept over several C.
- open loop (`open_loop`): N requests arriving as a Poisson process at R requests/s
  (exponential inter-arrival times from a seeded generator), whatever is in flight.

Per run it reports (docs/architecture.md §2 words): TTFT (request start to the first delta that
carries tokens), TPOT ((e2e - TTFT) / (completion tokens - 1)), inter-token latency (each
token of a delta gets the gap since the previous delta divided by the tokens the delta
carried), end-to-end latency, each as mean/p50/p90/p99; output tokens/s and requests/s
over the run's wall time; errors by gRPC status code name; acceptance rate α = accepted /
drafted; mean accepted length 1 + accepted / steps; and acceptance by draft position
(steps whose draft token i was accepted / steps that drafted position i).

Compare mode (`run_loadtest(..., compare=True)`, closed loop only) measures speculation on and
off against the same stack in one sweep: at each concurrency it runs the speculative run (the
settings' K: the server's default when None) and the speculation-off run (K = 0) back to back,
the same requests (prompts and seeds) in both, and swaps which goes first from one pair to the
next (speculative first at the first concurrency, off first at the second, ...; with repeats,
also from one repeat to the next) so slow drift of the machine favours neither. Each run is
tagged with its `mode` ("speculative" or "off") and `repeat`; the report's `comparison` has one
entry per concurrency: per mode the median-throughput run of its repeats (the lower middle one
for an even count), and the ratios speculative / off of output tokens/s and of TTFT p50.

Targets: specd's gRPC API (`GrpcTarget`, HOST:PORT) or any OpenAI-compatible `/v1/completions`
(`specd.bench.openai_client.OpenAiTarget`: vLLM, llama-server, TGI, SGLang, specd's own HTTP API),
several in one run. They are interleaved: at each concurrency (or rate) each target runs in turn,
in the order given, and each run names its `target` and `backend`. Only a gRPC target's runs carry
specd's own figures (α, K, calls per pass): an OpenAI stream does not say what the server drafted.
Beside this module's own names, each run has its figures under vLLM `bench serve`'s names
(`vllm_fields`: `output_throughput`, `mean_ttft_ms`, `p99_itl_ms`, `e2el`, `generated_texts`, ...).

Requests cycle through a prompts file (JSON lines, `{"prompt": ..., "kind": ...}`; the default
`prompts.jsonl` mixes code, docstrings, prose and chat, `prose.jsonl` is an LLMPerf-style prose
workload of sonnet lines) and ask for `ignore_eos` by default, so every request yields exactly
max_new_tokens and runs are comparable. The report's settings record the load tester's CPU
(`machine`: model name, avx512_bf16) beside the server's own Info. Every request is bounded by
a timeout; failures are counted, never raised.
Everything here is asyncio: run it with `asyncio.run`, or await it on a running loop. The tables
and plots of a report: bench/loadtest_report.py.
"""

import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np

from specd.proto.client import channel, make_request
from specd.v1 import common_pb2, specdecode_pb2, specdecode_pb2_grpc

WARMUP_REQUESTS = 2  # per mode, before the measured runs
WARMUP_TOKENS = 16
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
PROSE_PROMPTS = Path(__file__).resolve().parent / "prose.jsonl"  # LLMPerf-style: sonnet lines to stream on
LONG_PROMPTS = Path(__file__).resolve().parent / "long.jsonl"  # ~1,000-token code prompts (Python stdlib, PSF)
MODES = ("speculative", "off")  # compare mode's two runs per concurrency, in the order of its first pair

# start(label, total) -> advance(): how a caller shows progress (None: no progress shown).
ProgressHook = Callable[[str, int], Callable[[], None]]


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


# ---------------------------------------------------------------- prompts


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


def _prompt_of(line: str, path: Path, number: int) -> str:
    try:
        prompt = json.loads(line)["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise PromptsError(f'{path}:{number}: expected a JSON object with a "prompt" string ({error})') from error
    if not isinstance(prompt, str) or not prompt:
        raise PromptsError(f'{path}:{number}: "prompt" must be a non-empty string')
    return prompt


# ---------------------------------------------------------------- statistics


def percentiles(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation); all None for no values."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99])
    return {"mean": float(np.mean(values)), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def inter_token_latencies(delta_times: list[float], delta_tokens: list[int]) -> list[float]:
    """One latency per token after the first delta: the gap to the previous delta / tokens carried."""
    latencies = []
    for previous, now, tokens in zip(delta_times, delta_times[1:], delta_tokens[1:]):
        latencies += [(now - previous) / tokens] * tokens
    return latencies


def arrival_offsets(rate: float, count: int, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `count` Poisson arrivals at `rate`/s is sent."""
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        at += rng.expovariate(rate)
    return offsets


def acceptance_by_position(stats: list[specdecode_pb2.SpeculationStats]) -> list[float]:
    """For draft position i: steps whose guess i was accepted / steps that drafted a guess i (K > i)."""
    width = max((len(s.accepted_per_position) for s in stats), default=0)
    rates = []
    for position in range(width):
        accepted = sum(s.accepted_per_position[position] for s in stats if len(s.accepted_per_position) > position)
        drafted = sum(k > position for s in stats for k in s.draft_lengths)
        rates.append(accepted / drafted if drafted else 0.0)
    return rates


def speculation_summary(stats: list[specdecode_pb2.SpeculationStats]) -> dict:
    """α, mean accepted length, acceptance by position, and how often speculation was off (None: no data)."""
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    steps = sum(s.steps for s in stats)
    lengths = [k for s in stats for k in s.draft_lengths]
    drafting = [k for k in lengths if k]
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
        "acceptance_by_position": acceptance_by_position(stats),
        "speculation_off_share": lengths.count(0) / len(lengths) if lengths else None,  # target-only steps
        "mean_draft_length": sum(drafting) / len(drafting) if drafting else None,  # K of the drafting steps
        **source_summary(stats),
    }


def source_summary(stats: list[specdecode_pb2.SpeculationStats]) -> dict:
    """Of the drafting steps, the prompt lookup's share, and α of each source (None: it never drafted)."""
    steps = sum(s.drafting_steps for s in stats)
    lookup = [sum(getattr(s, f"lookup_{name}") for s in stats) for name in ("steps", "drafted", "accepted")]
    model = [sum(s.drafted for s in stats) - lookup[1], sum(s.accepted for s in stats) - lookup[2]]
    return {
        "lookup_step_share": lookup[0] / steps if steps else None,
        "lookup_acceptance_rate": lookup[2] / lookup[1] if lookup[1] else None,
        "model_acceptance_rate": model[1] / model[0] if model[0] else None,
    }


def summarize_run(
    results: list[RequestResult], wall: float, concurrency: int | None, rate: float | None, speculation: bool = True
) -> dict:
    """One entry of the report's `runs`; `speculation`: with specd's figures (α, K, ...: a gRPC target)."""
    done = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in done)
    speculative = speculation_summary([r.stats for r in done if r.stats is not None]) if speculation else {}
    return {
        "concurrency": concurrency,
        "rate": rate,
        "requests": len(results),
        "completed": len(done),
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(done) / wall if wall > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl_s": percentiles([x for r in done for x in inter_token_latencies(r.delta_times, r.delta_tokens)]),
        "e2e_s": percentiles([r.e2e for r in done]),
        **speculative,
        "errors": dict(sorted(Counter(r.error for r in results if not r.ok).items())),
        **vllm_fields(results, wall),
    }


def vllm_fields(results: list[RequestResult], wall: float) -> dict:
    """The run's figures under the names of vLLM `bench serve --save-result --metric-percentiles 50,90,99`
    (latencies in ms; `e2el` is e2e), so its scripts read these reports; the per-request lists
    (input_lens, output_lens, generated_texts, in request order) hold 0 / "" for a failed request."""
    done = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in done)
    fields = {
        "duration": wall,
        "total_input_tokens": sum(r.prompt_tokens or 0 for r in done),
        "total_output_tokens": tokens,
        "request_throughput": len(done) / wall if wall > 0 else 0.0,
        "output_throughput": tokens / wall if wall > 0 else 0.0,
    }
    latencies = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [x for r in done for x in inter_token_latencies(r.delta_times, r.delta_tokens)],
        "e2el": [r.e2e for r in done],
    }
    for name, seconds in latencies.items():
        ms = np.asarray(seconds, dtype=float) * 1000
        stats = {"mean": None, "median": None, "std": None, "p50": None, "p90": None, "p99": None}
        if len(ms):
            p50, p90, p99 = np.percentile(ms, [50, 90, 99])
            stats = {"mean": ms.mean(), "median": p50, "std": ms.std(), "p50": p50, "p90": p90, "p99": p99}
        fields |= {f"{stat}_{name}_ms": None if value is None else float(value) for stat, value in stats.items()}
    ordered = sorted(results, key=lambda r: r.index)
    fields["input_lens"] = [(r.prompt_tokens or 0) if r.ok else 0 for r in ordered]
    fields["output_lens"] = [r.completion_tokens if r.ok else 0 for r in ordered]
    fields["generated_texts"] = [r.text if r.ok else "" for r in ordered]
    return fields


# ---------------------------------------------------------------- requests


def build_request(settings: Settings, index: int) -> specdecode_pb2.GenerateRequest:
    """Request number `index`: the prompts in turn, a seed of its own."""
    prompt = settings.prompts[index % len(settings.prompts)]
    return make_request(
        prompt,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        seed=settings.seed + index,
        draft_tokens=settings.draft_tokens,
        drafter=settings.drafter,
        ignore_eos=settings.ignore_eos,
    )


async def send_one(stub: specdecode_pb2_grpc.SpecDecodeStub, settings: Settings, index: int) -> RequestResult:
    """Stream one request to its end, timing each delta; errors land in `error`, never raised."""
    result = RequestResult(started=time.perf_counter(), index=index)
    try:
        async with asyncio.timeout(settings.timeout + 5):  # the gRPC deadline should fire first
            await _stream(stub, build_request(settings, index), settings.timeout, result)
    except grpc.aio.AioRpcError as error:
        result.error = error.code().name
    except TimeoutError:
        result.error = grpc.StatusCode.DEADLINE_EXCEEDED.name
    except Exception as error:  # a load test counts what goes wrong and carries on
        result.error = type(error).__name__
    result.ended = time.perf_counter()
    return result


async def _stream(stub, request, timeout: float, result: RequestResult) -> None:
    final = None
    async for reply in stub.Generate(request, timeout=timeout):
        if reply.HasField("final"):
            final = reply.final
        elif reply.delta.token_ids:
            result.delta_times.append(time.perf_counter())
            result.delta_tokens.append(len(reply.delta.token_ids))
            result.text += reply.delta.text
    if final is None:
        result.error = "NO_FINAL_MESSAGE"
        return
    result.completion_tokens = final.usage.completion_tokens or sum(result.delta_tokens)
    result.prompt_tokens = final.usage.prompt_tokens or None
    result.stats = final.stats


class GrpcTarget:
    """A load-test target: specd's gRPC API (specd.v1.SpecDecode) at HOST:PORT, whose runs carry
    specd's figures (α, K, calls per pass). The other kind, an OpenAI-compatible server, is
    specd.bench.openai_client.OpenAiTarget; both have this interface."""

    backend = "grpc"
    speculation = True  # the runs carry α, K, acceptance by position and calls per pass

    def __init__(self, address: str):
        self.name = self.address = address
        self.info: dict | None = None

    async def open(self, timeout: float) -> None:
        self.channel = channel(self.address)
        self.stub = specdecode_pb2_grpc.SpecDecodeStub(self.channel)
        self.info = await _server_info(self.stub, timeout)

    async def close(self) -> None:
        await self.channel.close()

    async def send(self, settings: Settings, index: int) -> RequestResult:
        return await send_one(self.stub, settings, index)

    async def passes(self, timeout: float) -> dict | None:
        return await _passes(self.stub, timeout)

    def describe(self) -> dict:
        return {"name": self.name, "backend": self.backend, "address": self.address, "server_info": self.info}


# ---------------------------------------------------------------- runs


async def closed_loop(
    target, settings: Settings, concurrency: int, requests: int, advance: Callable[[], None] = lambda: None
) -> dict:
    """`concurrency` workers, each sending its next request when the previous ends, `requests` in all."""
    indices = itertools.count()
    results: list[RequestResult] = []

    async def worker() -> None:
        while (index := next(indices)) < requests:
            results.append(await target.send(settings, index))
            advance()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize_run(results, time.perf_counter() - started, concurrency, None, target.speculation)


async def open_loop(
    target, settings: Settings, rate: float, requests: int, advance: Callable[[], None] = lambda: None
) -> dict:
    """`requests` requests sent at Poisson arrival times of `rate` per second, however many are in flight."""

    async def tracked(index: int) -> RequestResult:
        result = await target.send(settings, index)
        advance()
        return result

    started = time.perf_counter()
    tasks = []
    for index, offset in enumerate(arrival_offsets(rate, requests, settings.seed)):
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(tracked(index)))
    results = await asyncio.gather(*tasks)
    return summarize_run(list(results), time.perf_counter() - started, None, rate, target.speculation)


async def run_loadtest(
    settings: Settings,
    requests: int,
    concurrency: list[int] = (),
    rates: list[float] = (),
    progress: ProgressHook | None = None,
    prompts_file: str | None = None,
    compare: bool = False,
    repeats: int = 1,
    warmup: int = WARMUP_REQUESTS,
    targets: list | None = None,
) -> dict:
    """A closed-loop run per concurrency level, then an open-loop run per rate: {"runs": [...], "settings": {...}}.

    `targets`: GrpcTarget and OpenAiTarget (default: one GrpcTarget at settings.server); at each
    level every target runs in turn. With `compare` (one gRPC target): closed loop only, a
    speculative and an off run per concurrency and repeat (`compare_plan`), and a "comparison"
    list in the report (`comparison`). First, `warmup` short requests per target and mode, not
    measured: the first run would otherwise pay the stack's cold start (and the K chooser's first
    measurements) alone. An OpenAI target that cannot be used raises openai_client.TargetError.
    """
    targets = list(targets) if targets else [GrpcTarget(settings.server)]
    names = [target.name for target in targets]
    if len(set(names)) < len(names):
        raise ValueError(f"a target is given twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    if compare and (rates or settings.draft_tokens == 0 or repeats < 1):
        raise ValueError("compare: closed loop only, a speculative K (None or >= 1), repeats >= 1")
    if compare and (len(targets) != 1 or targets[0].backend != "grpc"):
        raise ValueError("compare measures speculation on and off of one gRPC target: give just one")
    if compare:
        plans = [("closed", level, mode, repeat) for level, mode, repeat in compare_plan(concurrency, repeats)]
    else:
        mode = mode_of(settings)
        plans = [("closed", c, mode, 0) for c in concurrency] + [("open", r, mode, 0) for r in rates]
    runs = []
    async with contextlib.AsyncExitStack() as stack:
        for target in targets:
            await target.open(settings.timeout)
            stack.push_async_callback(target.close)
        for target in targets:  # not measured
            modes = dict.fromkeys(plan[2] for plan in plans) if target.speculation else [None]
            for mode in modes if warmup else ():
                warm = replace(settings, max_new_tokens=min(settings.max_new_tokens, WARMUP_TOKENS))
                await closed_loop(target, replace(warm, draft_tokens=0) if mode == "off" else warm, 1, warmup)
        for (kind, level, mode, repeat), target in itertools.product(plans, targets):
            label = f"concurrency {level}" if kind == "closed" else f"rate {level:g}/s"
            if compare:
                label += f" {mode}" + (f" #{repeat + 1}" if repeats > 1 else "")
            if len(targets) > 1:
                label += f" {target.name}"
            advance = progress(label, requests) if progress else (lambda: None)
            run = closed_loop if kind == "closed" else open_loop
            run_settings = replace(settings, draft_tokens=0) if mode == "off" else settings
            before = await target.passes(settings.timeout)
            result = await run(target, run_settings, level, requests, advance)
            if target.speculation:
                result.update(calls_per_pass(before, await target.passes(settings.timeout)))
            mode_shown = mode if target.speculation else None  # K is a gRPC request's setting
            runs.append(
                {"target": target.name, "backend": target.backend, "mode": mode_shown, "repeat": repeat, **result}
            )
    report = {"runs": runs}
    if compare:
        report["comparison"] = comparison(runs)
    server_info = next((target.info for target in targets if target.backend == "grpc"), None)
    report["settings"] = _settings_dict(settings, requests, concurrency, rates, prompts_file, server_info)
    report["settings"] |= {"compare": compare, "repeats": repeats, "warmup_requests": warmup}
    report["settings"]["targets"] = [target.describe() for target in targets]
    return report


def mode_of(settings: Settings) -> str:
    """The mode of a run with these settings: `off` for K = 0, else `speculative`."""
    return "off" if settings.draft_tokens == 0 else "speculative"


def compare_plan(concurrency: list[int], repeats: int = 1) -> list[tuple[int, str, int]]:
    """(concurrency, mode, repeat) of each run, in the order compare mode runs them: per concurrency,
    `repeats` pairs back to back; the first pair of concurrency i starts with MODES[i % 2] and
    each further repeat swaps the order again, so neither mode always runs first."""
    plan = []
    for index, level in enumerate(concurrency):
        for repeat in range(repeats):
            order = MODES if (index + repeat) % 2 == 0 else MODES[::-1]
            plan += [(level, mode, repeat) for mode in order]
    return plan


def median_run(runs: list[dict], indices: list[int]) -> int:
    """The index (into `runs`) of the median-throughput run among `indices` (lower middle for an even count)."""
    ranked = sorted(indices, key=lambda i: runs[i]["output_tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2]


def comparison(runs: list[dict]) -> list[dict]:
    """Per concurrency that has both modes: each mode's median-throughput run (`run`: its index
    in `runs`) and figures, and the ratios speculative / off of output tokens/s and TTFT p50
    (None where the off figure is 0 or missing)."""
    entries = []
    for level in dict.fromkeys(run["concurrency"] for run in runs if run["concurrency"] is not None):
        indices = {
            mode: [i for i, run in enumerate(runs) if run["concurrency"] == level and run.get("mode") == mode]
            for mode in MODES
        }
        if not all(indices.values()):
            continue
        figures = {mode: _mode_figures(runs, median_run(runs, indices[mode]), indices[mode]) for mode in MODES}
        spec, off = figures["speculative"], figures["off"]
        entries.append(
            {
                "concurrency": level,
                **figures,
                "throughput_ratio": _ratio(spec["output_tokens_per_s"], off["output_tokens_per_s"]),
                "ttft_p50_ratio": _ratio(spec["ttft_p50_s"], off["ttft_p50_s"]),
            }
        )
    return entries


def _mode_figures(runs: list[dict], index: int, indices: list[int]) -> dict:
    run = runs[index]
    return {
        "run": index,
        "output_tokens_per_s": run["output_tokens_per_s"],
        "ttft_p50_s": run["ttft_s"]["p50"],
        "acceptance_rate": run["acceptance_rate"],
        **{key: run.get(key) for key in ("lookup_step_share", "lookup_acceptance_rate", "model_acceptance_rate")},
        "mean_draft_length": run["mean_draft_length"],  # mean K of the drafting steps
        "speculation_off_share": run["speculation_off_share"],  # share of steps with K = 0
        "target_tokens_per_pass": run.get("target_tokens_per_pass"),  # target rows per batched pass
        "output_tokens_per_s_all": [runs[i]["output_tokens_per_s"] for i in indices],  # every repeat, run order
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def cpu_tag() -> str:
    """This CPU's widest vector extension, for a results file's name: avx512_bf16, avx512 or avx2."""
    flags = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return "avx512_bf16" if "avx512_bf16" in flags else "avx512" if "avx512f" in flags else "avx2"


def machine_info() -> dict:
    """The CPU this load test runs on (figures on this project are always stated with the CPU):
    its model name and whether it has avx512_bf16 (None: unknown, no /proc/cpuinfo)."""
    name, flags = None, None
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name is None:
            name = value.strip()
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    return {
        "cpu_model": name or platform.processor() or None,
        "avx512_bf16": None if flags is None else "avx512_bf16" in flags,
        "cpu_count": os.cpu_count(),
    }


async def _server_info(stub, timeout: float) -> dict | None:
    """The served pair and default K, for the record; None when the server does not answer."""
    try:
        info = await stub.Info(common_pb2.InfoRequest(), timeout=min(timeout, 10.0))
    except grpc.aio.AioRpcError:
        return None
    return {
        "draft_model": info.draft.model,
        "target_model": info.target.model,
        "dtype": info.target.dtype,
        "default_draft_tokens": None if info.adaptive_draft_tokens else info.default_draft_tokens,
        "max_draft_tokens": info.max_draft_tokens,
        "draft_quantization": info.draft.quantization,
        "draft_device": info.draft.device,
        "target_device": info.target.device,
        "target_device_name": info.target.device_name,
        "workers": info.workers,
    }


async def _passes(stub, timeout: float) -> dict[str, Counter] | None:
    """Passes each service has run so far, by calls per pass (its Info's batch_sizes); None if unanswered."""
    try:
        info = await stub.Info(common_pb2.InfoRequest(), timeout=min(timeout, 10.0))
    except grpc.aio.AioRpcError:
        return None
    return {
        role: (Counter(dict(service.batch_sizes)), service.batched_tokens)
        for role, service in (("draft", info.draft), ("target", info.target))
    }


def calls_per_pass(before: dict | None, after: dict | None) -> dict:
    """Mean calls (one per session) and new tokens (rows) in each service's batched passes between two
    readings: how much the services batched during a run (1.0 call: never; other load on the same
    services counts too)."""
    means = {}
    for role in ("draft", "target"):
        ran = after[role][0] - before[role][0] if before and after else Counter()
        tokens = after[role][1] - before[role][1] if before and after else 0
        passes = sum(ran.values())
        means[f"{role}_calls_per_pass"] = sum(size * n for size, n in ran.items()) / passes if passes else None
        means[f"{role}_tokens_per_pass"] = tokens / passes if passes else None
    return means


def _settings_dict(settings: Settings, requests: int, concurrency, rates, prompts_file, server_info) -> dict:
    record = asdict(settings)
    record["prompts"] = len(settings.prompts)
    return {
        **record,
        "prompts_file": prompts_file,
        "requests": requests,
        "concurrency": list(concurrency),
        "rates": list(rates),
        "server_info": server_info,  # the server's pair and devices (target_device_name: its CPU or GPU)
        "machine": machine_info(),  # the load tester's CPU
    }
