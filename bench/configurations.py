"""`specd bench --configurations`: which way of serving one request is fastest on this machine, each
engine × drafter side by side on the same prompts, and where the default stands against the fastest.

For each engine (`--engines`, default llama.cpp and transformers where this machine has them), two
local stacks in turn: one with a draft service, where requests run K auto with the `hybrid` drafter
(the default: `specd up` with no flags), with the `model` drafter, and target-only (K = 0); and one
without (as `specd up --drafter suffix` starts it: the target alone has the cores), where requests
run the `suffix` and `ngram` drafters and target-only. On each prompt the configurations of a stack
run in turn (interleaved, so machine drift falls on all alike), greedy, exactly --max-new-tokens
tokens each (EOS ignored), every configuration under a cache salt of its own so that no
configuration's drafter or prefix cache learns from another's outputs of the same prompt. The stacks
run as `specd up` runs them here: each service's share of the cores (the target all of them, a draft
a quarter) and its waiting threads asleep (deploy/local.py share_cores, SHARED_CORES_ENV).

The report: tokens/s per configuration (all its tokens over all its seconds), α, the steps off,
whether its text equals its stack's target-only text on every prompt, the fastest, and the default's
ratio to the fastest (issue 50 asks for within 5 %).
"""

from __future__ import annotations

import asyncio
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specd.bench.systems import WARMUP_PROMPT, BenchSettings, Run, SpecdSystems, load_average, machine_facts

DEFAULT = "llama.cpp hybrid"  # `specd up` with no flags on a CPU with the default pair's GGUF: engine auto
WITH_DRAFT = (("hybrid", None), ("model", None), ("target-only", 0))  # (drafter, K: None is auto)
WITHOUT_DRAFT = (("suffix", None), ("ngram", None), ("target-only", 0))


@dataclass
class Configuration:
    engine: str
    drafter: str  # or "target-only"
    draft_service: bool
    runs: list[Run] = field(default_factory=list)

    @property
    def name(self) -> str:
        where = "" if self.draft_service or self.drafter != "target-only" else " (no draft)"
        return f"{self.engine} {self.drafter}{where}"


async def run_configurations(
    settings: BenchSettings, engines: list[str], say: Callable[[str], None] = print, advance=None
) -> dict:
    """Every configuration of every engine in `engines` on settings.prompts; the report (see the docstring)."""
    from specd.deploy.local import SHARED_CORES_ENV, LocalStack, StackConfig
    from specd.model.fetch import resolve_tokenizer
    from specd.model.loaded import folder_tokenizer
    from specd.proto.client import channel
    from specd.v1 import specdecode_pb2_grpc

    tokenizer = folder_tokenizer(resolve_tokenizer(settings.target.model))[0]
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in settings.prompts]
    configurations, before = [], load_average()
    threads = stack_threads(settings)
    for engine in engines:
        for draft_service, drafters in ((True, WITH_DRAFT), (False, WITHOUT_DRAFT)):
            config = StackConfig(
                dtype=settings.dtype,
                draft=replace(settings.draft, engine=engine, threads=threads["draft"]),
                # without a draft service the target has the cores to itself, as `specd up --drafter suffix`
                target=replace(settings.target, engine=engine, threads=threads["target" if draft_service else "alone"]),
                drafter=None if draft_service else "suffix",  # a stack without a draft service
                service_env=SHARED_CORES_ENV,
                workers=1,
            )
            stack = await LocalStack(config, say=say).start()
            try:
                async with channel(stack.address) as open_channel:
                    specd = SpecdSystems(specdecode_pb2_grpc.SpecDecodeStub(open_channel), settings.timeout)
                    group = [Configuration(engine, drafter, draft_service) for drafter, _ in drafters]
                    await _run_group(specd, group, drafters, prompt_ids, settings, tokenizer, advance)
                    configurations += group
            finally:
                stack.stop()
    return _report(settings, engines, configurations, {"load_average_before": before})


def stack_threads(settings: BenchSettings) -> dict[str, int | None]:
    """Each service's threads as `specd up` gives them here (cli/up.py service_threads): --threads where
    given, else their share of the cores for those that compute on the CPU (deploy/local.py share_cores);
    `alone`: the target's in a stack without a draft."""
    from specd.deploy.local import share_cores, usable_cores
    from specd.model.devices import resolve_device

    if settings.threads:
        return dict.fromkeys(("draft", "target", "alone"), settings.threads)
    roles = {"draft": settings.draft, "target": settings.target}
    on_cpu = [role for role, config in roles.items() if resolve_device(role, config.device or "auto").type == "cpu"]
    shared = share_cores(usable_cores(), on_cpu)
    alone = share_cores(usable_cores(), [role for role in on_cpu if role == "target"])
    return {"draft": shared.get("draft"), "target": shared.get("target"), "alone": alone.get("target")}


async def _run_group(specd, group, drafters, prompt_ids, settings, tokenizer, advance) -> None:
    n = settings.max_new_tokens
    salts = {configuration.name: f"bench-{configuration.name}-{time.time_ns()}" for configuration in group}

    async def run(configuration: Configuration, ids: list[int], k: int | None, drafter: str, tokens: int) -> Run:
        return await specd.run(
            ids, tokens, k, "" if drafter == "target-only" else drafter, salt=salts[configuration.name]
        )

    warmup = tokenizer(WARMUP_PROMPT)["input_ids"]
    for configuration, (drafter, k) in zip(group, drafters):
        await run(configuration, warmup, k, drafter, min(n, 8))
    for index, ids in enumerate(prompt_ids):
        for configuration, (drafter, k) in zip(group, drafters):
            configuration.runs.append(await run(configuration, ids, k, drafter, n))
            if advance:
                advance(f"prompt {index + 1}/{len(prompt_ids)} {configuration.name}")


def _report(settings: BenchSettings, engines: list[str], configurations: list[Configuration], environment) -> dict:
    results = {}
    for configuration in configurations:
        baseline = next(
            (
                c
                for c in configurations
                if c.engine == configuration.engine
                and c.draft_service == configuration.draft_service
                and c.drafter == "target-only"
            ),
            None,
        )
        tokens = sum(run.tokens for run in configuration.runs)
        seconds = sum(run.seconds for run in configuration.runs)
        stats = [run.stats or {} for run in configuration.runs]
        drafted = sum(int(s.get("drafted", 0)) for s in stats)
        accepted = sum(int(s.get("accepted", 0)) for s in stats)
        steps = sum(int(s.get("steps", 0)) for s in stats)
        off = sum(sum(1 for k in s.get("draft_lengths", []) if not k) for s in stats)
        results[configuration.name] = {
            "engine": configuration.engine,
            "drafter": configuration.drafter,
            "draft_service": configuration.draft_service,
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": tokens / seconds if seconds else None,
            "alpha": accepted / drafted if drafted else None,
            "steps": steps,
            "steps_off": off,
            "same_text_as_target_only": None
            if baseline is None
            else all(run.token_ids == base.token_ids for run, base in zip(configuration.runs, baseline.runs)),
            "per_prompt_tokens_per_s": [
                run.tokens / run.seconds if run.seconds else None for run in configuration.runs
            ],
        }
    fastest = max(results, key=lambda name: results[name]["tokens_per_s"] or 0.0)
    default = results.get(DEFAULT)
    return {
        "results": results,
        "fastest": fastest,
        "default": DEFAULT if default else None,
        "default_vs_fastest": (default["tokens_per_s"] / results[fastest]["tokens_per_s"]) if default else None,
        "settings": {
            "prompts": len(settings.prompts),
            "prompts_file": settings.prompts_file,
            "max_new_tokens": settings.max_new_tokens,
            "engines": engines,
            "dtype": settings.dtype,
            "threads": settings.threads,
        },
        "environment": {
            **environment,
            "load_average_after": load_average(),
            "python": platform.python_version(),
            "order": "per stack, interleaved per prompt: "
            + "; ".join(" ".join(d for d, _ in drafters) for drafters in (WITH_DRAFT, WITHOUT_DRAFT)),
            **machine_facts(),
        },
    }


def summary_rows(report: dict) -> list[tuple[str, ...]]:
    """One row per configuration, fastest first: name, tokens/s, ÷ fastest, α, steps off, same text."""
    results, fastest = report["results"], report["fastest"]
    top = results[fastest]["tokens_per_s"] or 1.0
    rows = []
    for name, result in sorted(results.items(), key=lambda item: -(item[1]["tokens_per_s"] or 0.0)):
        alpha = result["alpha"]
        rows.append(
            (
                name + ("  (default)" if name == report["default"] else ""),
                f"{result['tokens_per_s']:.2f}" if result["tokens_per_s"] else "-",
                f"{(result['tokens_per_s'] or 0.0) / top:.2f}×",
                f"{alpha:.2f}" if alpha is not None else "-",
                f"{result['steps_off']} of {result['steps']}",
                {True: "yes", False: "no", None: "-"}[result["same_text_as_target_only"]],
            )
        )
    return rows


def save_plot(report: dict, path) -> None:
    """Tokens/s per configuration, the default's bar marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = sorted(results, key=lambda name: -(results[name]["tokens_per_s"] or 0.0))
    values = [results[name]["tokens_per_s"] or 0.0 for name in names]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4.5))
    colors = ["#c44e52" if name == report["default"] else "#4c72b0" for name in names]
    bars = axes.bar(range(len(names)), values, color=colors)
    axes.bar_label(bars, fmt="%.1f")
    axes.set_xticks(range(len(names)), [name.replace(" ", "\n", 1) for name in names], fontsize=8)
    settings, machine = report["settings"], report["environment"]
    axes.set(
        ylabel="tokens/s (one request at a time)",
        title=f"engine × drafter, {settings['prompts']} prompts × {settings['max_new_tokens']} tokens, greedy; "
        f"{machine.get('cpu', '')} (red: the default)",
    )
    axes.title.set_fontsize(9)
    axes.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(settings: BenchSettings, engines: list[str], say, advance=None) -> dict:
    return asyncio.run(run_configurations(settings, engines, say, advance))
