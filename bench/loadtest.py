"""The load tester behind `specd loadtest`: it offers load to one or more targets and returns the
report (`run_loadtest`). Two ways to offer load:

- closed loop (`closed_loop`): C workers, each sending its next request as soon as its
  previous one ends, until N requests are done; swept over several C.
- open loop (`open_loop`): N requests arriving as a Poisson process at R requests/s
  (exponential inter-arrival times from a seeded generator), whatever is in flight.

Compare mode (`run_loadtest(..., compare=True)`, closed loop only) measures speculation on and
off against the same stack in one sweep: at each concurrency it runs the speculative run (the
settings' K: the server's default when None) and the speculation-off run (K = 0) back to back,
the same requests (prompts and seeds) in both, and swaps which goes first from one pair to the
next (speculative first at the first concurrency, off first at the second, ...; with repeats,
also from one repeat to the next) so slow drift of the machine favours neither. Each run is
tagged with its `mode` ("speculative" or "off") and `repeat`; the report's `comparison` has one
entry per concurrency (loadtest_stats.comparison).

Targets: specd's gRPC API (`GrpcTarget`, HOST:PORT, grpc_target.py) or any OpenAI-compatible
`/v1/completions` (`specd.bench.openai_client.OpenAiTarget`: vLLM, llama-server, TGI, SGLang,
specd's own HTTP API), several in one run. They are interleaved: at each concurrency (or rate)
each target runs in turn, in the order given, and each run names its `target` and `backend`. Only
a gRPC target's runs carry specd's own figures (α, K, calls per pass): an OpenAI stream does not
say what the server drafted.

The parts: workload.py (the prompt files, `Settings`, `RequestResult`), grpc_target.py (the gRPC
target), loadtest_stats.py (each run's figures: TTFT, TPOT, ITL, e2e, tokens/s, α, ..., and vLLM's
names for them), loadtest_report.py (the tables and plots). Their public names are importable from
here too (`__all__`). Requests ask for `ignore_eos` by default, so every request yields exactly
max_new_tokens and runs are comparable. The report's settings record the load tester's CPU
(`machine`: model name, avx512_bf16) beside the server's own Info. Every request is bounded by a
timeout; failures are counted, never raised. Everything here is asyncio: run it with
`asyncio.run`, or await it on a running loop.
"""

import asyncio
import contextlib
import itertools
import os
import platform
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from specd.bench.grpc_target import GrpcTarget, build_request
from specd.bench.loadtest_stats import (
    MODES,
    calls_per_pass,
    comparison,
    inter_token_latencies,
    median_run,
    percentiles,
    source_summary,
    speculation_summary,
    summarize_run,
    vllm_fields,
)
from specd.bench.workload import (
    DEFAULT_PROMPTS,
    LONG_PROMPTS,
    PROSE_PROMPTS,
    PromptsError,
    RequestResult,
    Settings,
    load_prompts,
    shared_contexts,
)

__all__ = [  # the load tester's public names, wherever they live
    "DEFAULT_PROMPTS",
    "LONG_PROMPTS",
    "MODES",
    "PROSE_PROMPTS",
    "GrpcTarget",
    "PromptsError",
    "RequestResult",
    "Settings",
    "arrival_offsets",
    "build_request",
    "calls_per_pass",
    "closed_loop",
    "compare_plan",
    "comparison",
    "cpu_tag",
    "inter_token_latencies",
    "load_prompts",
    "machine_info",
    "median_run",
    "mode_of",
    "open_loop",
    "percentiles",
    "run_loadtest",
    "shared_contexts",
    "source_summary",
    "speculation_summary",
    "summarize_run",
    "vllm_fields",
]

WARMUP_REQUESTS = 2  # per mode, before the measured runs
WARMUP_TOKENS = 16

# start(label, total) -> advance(): how a caller shows progress (None: no progress shown).
ProgressHook = Callable[[str, int], Callable[[], None]]


def arrival_offsets(rate: float, count: int, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `count` Poisson arrivals at `rate`/s is sent."""
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        at += rng.expovariate(rate)
    return offsets


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
    unique_prompts: bool = False,
) -> dict:
    """A closed-loop run per concurrency level, then an open-loop run per rate: {"runs": [...], "settings": {...}}.

    `targets`: GrpcTarget and OpenAiTarget (default: one GrpcTarget at settings.server); at each
    level every target runs in turn. With `compare` (one gRPC target): closed loop only, a
    speculative and an off run per concurrency and repeat (`compare_plan`), and a "comparison"
    list in the report (`comparison`). First, `warmup` short requests per target and mode, not
    measured: the first run would otherwise pay the stack's cold start (and the K chooser's first
    measurements) alone. An OpenAI target that cannot be used raises openai_client.TargetError.
    `unique_prompts`: every run and warm-up opens its prompts with a tag of its own
    (Settings.unique_tag), so that no prompt repeats within the load test.
    """
    tagged = (lambda s: replace(s, unique_tag=secrets.token_hex(4))) if unique_prompts else (lambda s: s)
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
                warm = replace(warm, draft_tokens=0) if mode == "off" else warm
                await closed_loop(target, tagged(warm), 1, warmup)
        for (kind, level, mode, repeat), target in itertools.product(plans, targets):
            label = f"concurrency {level}" if kind == "closed" else f"rate {level:g}/s"
            if compare:
                label += f" {mode}" + (f" #{repeat + 1}" if repeats > 1 else "")
            if len(targets) > 1:
                label += f" {target.name}"
            advance = progress(label, requests) if progress else (lambda: None)
            run = closed_loop if kind == "closed" else open_loop
            run_settings = tagged(replace(settings, draft_tokens=0) if mode == "off" else settings)
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
    report["settings"] |= {
        "compare": compare,
        "repeats": repeats,
        "warmup_requests": warmup,
        "unique_prompts": unique_prompts,
    }
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


def _settings_dict(settings: Settings, requests: int, concurrency, rates, prompts_file, server_info) -> dict:
    record = asdict(settings)
    record["prompts"] = len(settings.prompts)
    record["shared_prefixes"] = len(settings.shared_prefixes)  # how many, not their text
    return {
        **record,
        "prompts_file": prompts_file,
        "requests": requests,
        "concurrency": list(concurrency),
        "rates": list(rates),
        "server_info": server_info,  # the server's pair and devices (target_device_name: its CPU or GPU)
        "machine": machine_info(),  # the load tester's CPU
    }
