"""The peer benchmark: specd against Hugging Face `generate` on the same prompts and settings.

Four systems, batch 1, greedy, every one producing exactly max_new_tokens tokens (EOS is
ignored by all four: HF's models get a generation config without an eos_token_id, specd's
requests ask for `ignore_eos`):

- `hf_target`    transformers `target.generate(do_sample=False)`, in this process;
- `hf_assisted`  `target.generate(assistant_model=draft)`, greedy, transformers' own
                 assistant schedule (its defaults), in this process;
- `specd_target` specd with speculation off (K = 0) through the gRPC services and the Ray
                 orchestrator (a LocalStack: three processes, or --server);
- `specd_spec`   specd speculative: K chosen every step (adaptive, the default), or a fixed
                 K = draft_tokens; its draft as the service loads it (int4 on a CPU by default).

Runs are interleaved per prompt (A B C D, A B C D, ...) so slow drift of the machine falls
on all four alike, and each system is warmed up once on a short prompt before timing.
Every system gets the same prompt token ids (the tokenizer's, without special tokens, as
the orchestrator tokenizes text); specd is timed on the client, from sending the request to
the end of its stream, so gRPC and orchestration count against it.

Figures (docs/architecture.md §2 words): tokens/s = total tokens / total seconds over the prompts;
α = accepted / drafted and mean accepted length = 1 + accepted / steps, from specd's final
stats; c = median over prompts of specd_spec's draft seconds per drafted token / median of
specd_target's seconds per decode step (both include their gRPC round trip); the analytic
best speed-up = max over K = 1..8 of (1 - α^(K+1)) / ((1 - α)(K·c + 1)); greedy_match =
both specd outputs equal hf_target's token ids on every prompt. Per prompt the report also has
the K of every step (adaptive K over time; 0 = target-only), α and c, and the per-prompt
ratios whose medians are `median_ratios`.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SYSTEMS = ("hf_target", "hf_assisted", "specd_target", "specd_spec")
LABELS = {"hf_target": "HF target only", "hf_assisted": "HF assisted (assistant_model)",
          "specd_target": "specd, K = 0 (target only)", "specd_spec": "specd speculative"}
QUICK_PROMPTS = 4
QUICK_TOKENS = 32
DEFAULT_TOKENS = 64
WARMUP_PROMPT = "def add(a, b):\n"
ANALYTIC_MAX_K = 8
PROMPT_RATIOS = ("specd_spec/hf_assisted", "specd_spec/specd_target", "specd_spec/hf_target", "hf_assisted/hf_target")

# called after each timed run with a label such as "prompt 3/24 specd_spec"
Advance = Callable[[str], None]


@dataclass
class BenchSettings:
    prompts: list[str]
    kinds: list[str] = field(default_factory=list)  # one per prompt ("" when unknown)
    max_new_tokens: int = DEFAULT_TOKENS
    draft_tokens: int | None = None  # None: adaptive (the orchestrator chooses K every step)
    draft_quantize: str | None = None  # the draft service's --quantize (None: its default)
    dtype: str | None = None  # None: load_model's default for this machine
    threads: int | None = None
    draft_model: str = "draft"
    target_model: str = "target"
    server: str | None = None  # a running orchestrator instead of a LocalStack
    timeout: float = 600.0  # seconds per specd request
    prompts_file: str | None = None
    quick: bool = False


@dataclass
class Run:
    """One system on one prompt."""

    token_ids: list[int]
    seconds: float
    stats: dict | None = None  # specd's SpeculationStats as a dict

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def load_prompts(path: Path | str) -> tuple[list[str], list[str]]:
    """Prompts and their kinds from a JSON-lines file of {"prompt": ..., "kind": ...} (loadtest's format)."""
    import json

    from specd.bench.loadtest import load_prompts as checked_prompts

    prompts = checked_prompts(path)  # raises loadtest.PromptsError with a line number on bad input
    kinds = [str(json.loads(line).get("kind", "")) for line in Path(path).read_text().splitlines() if line.strip()]
    return prompts, kinds


# ---------------------------------------------------------------- maths


def expected_speedup(alpha: float, c: float, k: int) -> float:
    """(1 - α^(K+1)) / ((1 - α)(K·c + 1)): the textbook speed-up, verifying K + 1 tokens at the price of one."""
    from specd.orchestrator.adaptive import expected_tokens

    return expected_tokens(alpha, k) / (k * c + 1)


def analytic_best(alpha: float | None, c: float | None, max_k: int = ANALYTIC_MAX_K) -> tuple[float | None, int | None]:
    """The best expected speed-up over K = 1..max_k for this α and c, and the K that gives it."""
    if alpha is None or c is None:
        return None, None
    best_k = max(range(1, max_k + 1), key=lambda k: expected_speedup(alpha, c, k))
    return expected_speedup(alpha, c, best_k), best_k


def measured_costs(spec_stats: list[dict], target_stats: list[dict]) -> dict:
    """Seconds inside the services, medians over all steps: a target-only step, a drafted token,
    and a Verify by K (the K the orchestrator chose), from each step's own times."""
    steps = [(k, draft, verify) for s in spec_stats
             for k, draft, verify in zip(s.get("draft_lengths", []), s.get("step_draft_seconds", []),
                                         s.get("step_verify_seconds", []))]
    decode = [t for s in target_stats for t in s.get("step_verify_seconds", [])]
    verify_by_k: dict[int, list[float]] = {}
    for k, _, verify in steps:
        verify_by_k.setdefault(k, []).append(verify)
    return {
        "target_step_s": _median(decode),
        "draft_token_s": _median([draft / k for k, draft, _ in steps if k]),
        "verify_s_by_k": {k: statistics.median(times) for k, times in sorted(verify_by_k.items()) if k},
    }


def achievable_best(alpha: float | None, costs: dict) -> tuple[float | None, int | None]:
    """The best expected speed-up over target-only with the *measured* verify cost of each K used
    (the textbook assumes t_verify(K) = one step; on a CPU it is not), K = 0 included."""
    step, draft = costs["target_step_s"], costs["draft_token_s"]
    if alpha is None or not step or draft is None:
        return None, None
    from specd.orchestrator.adaptive import expected_tokens

    speedups = {0: 1.0, **{k: expected_tokens(alpha, k) * step / (k * draft + verify)
                           for k, verify in costs["verify_s_by_k"].items()}}
    k = max(speedups, key=speedups.get)
    return speedups[k], k


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ---------------------------------------------------------------- the systems


class HFSystems:
    """hf_target and hf_assisted: transformers `generate` on models loaded in this process."""

    def __init__(self, draft, target):
        from transformers import GenerationConfig

        self.draft, self.target = draft, target
        # A clean generation config: greedy, no repetition penalty or sampling defaults a model
        # directory may carry, and no eos_token_id, so generation never stops early (EOS ignored).
        # It has to replace the models' own config during generate(): generate() fills every
        # unset (None) field of the one passed in from the model's, eos_token_id included.
        pad = target.tokenizer.pad_token_id
        pad = pad if pad is not None else (target.eos_token_ids or [0])[0]
        self.config = GenerationConfig(pad_token_id=pad)
        self.assistant_defaults = _assistant_defaults(self.config)

    def encode(self, prompt: str) -> list[int]:
        return list(self.target.tokenizer(prompt, add_special_tokens=False).input_ids)

    def run(self, prompt_ids: list[int], max_new_tokens: int, assisted: bool) -> Run:
        import torch

        from transformers.utils import logging as hf_logging

        ids = torch.tensor([prompt_ids])
        extra = {"assistant_model": self.draft.model} if assisted else {}
        models = (self.target.model, self.draft.model)
        saved = [model.generation_config for model in models]
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # assisted generate warns about its own internal call
        try:
            for model in models:  # restored below: the models may be shared (in-process services)
                model.generation_config = copy.deepcopy(self.config)
            with torch.inference_mode():
                started = time.perf_counter()
                output = self.target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                    max_new_tokens=max_new_tokens, **extra)
                seconds = time.perf_counter() - started
        finally:
            hf_logging.set_verbosity(verbosity)
            for model, config in zip(models, saved):
                model.generation_config = config
        return Run(output[0, len(prompt_ids):].tolist(), seconds)


def _assistant_defaults(config) -> dict:
    """The assisted-generation settings generate() will use (unset fields take transformers' defaults)."""
    try:
        defaults = config._get_default_generation_params()
    except AttributeError:  # older transformers keep the defaults on the config itself
        defaults = {}
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {name: getattr(config, name, None) if getattr(config, name, None) is not None else defaults.get(name)
            for name in names}


class SpecdSystems:
    """specd_target and specd_spec: Generate calls to an orchestrator over gRPC."""

    def __init__(self, stub, timeout: float):
        self.stub, self.timeout = stub, timeout

    async def run(self, prompt_ids: list[int], max_new_tokens: int, draft_tokens: int | None) -> Run:
        from google.protobuf.json_format import MessageToDict

        from specd.proto.client import complete
        from specd.v1 import common_pb2, specdecode_pb2

        request = specdecode_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens, draft_tokens=draft_tokens,
            ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0.0))  # None: unset, the server's K
        completion = await complete(self.stub, request, timeout=self.timeout)
        seconds = time.perf_counter() - completion.started
        if completion.final is None:
            raise RuntimeError("the orchestrator ended the stream without a final message")
        stats = MessageToDict(completion.final.stats, preserving_proto_field_name=True,
                              always_print_fields_with_no_presence=True)
        return Run(completion.token_ids, seconds, stats)


# ---------------------------------------------------------------- the run


async def run_bench(settings: BenchSettings, advance: Advance | None = None, say: Callable[[str], None] = print,
                    models: tuple | None = None) -> dict:
    """Start what is needed, run the interleaved benchmark, return the report (see `build_report`).

    `models`: an already loaded (draft, target) pair of LoadedModel to use for the HF systems
    (default: load settings.draft_model / target_model in settings.dtype here).
    """
    from specd.model.loading import default_dtype, load_model

    dtype = settings.dtype or default_dtype()
    environment = {"load_average_before": _load_average()}
    stack = None
    try:
        address = settings.server
        if address is None:
            from specd.deploy.local import LocalStack, StackConfig

            stack = LocalStack(StackConfig(dtype=dtype, threads=settings.threads, draft_model=settings.draft_model,
                                           target_model=settings.target_model, workers=1,
                                           draft_quantize=settings.draft_quantize), say=say)
            await stack.start()
            address = stack.address
        if models is None:
            say(f"loading the HF baselines ({settings.draft_model}, {settings.target_model}) in {dtype}")
            models = (load_model(settings.draft_model, dtype, settings.threads),
                      load_model(settings.target_model, dtype, settings.threads))
        hf = HFSystems(*models)
        runs = await _run_all(settings, hf, address, advance, say)
        server_info = runs.pop("server_info")
    finally:
        if stack:
            stack.stop()
    environment["load_average_after"] = _load_average()
    return build_report(settings, runs, [hf.encode(p) for p in settings.prompts], {
        "dtype": str(models[1].dtype).removeprefix("torch."), "server": settings.server, "server_info": server_info,
        "hf_assisted_generation": hf.assistant_defaults, **environment, **_machine()})


async def _run_all(settings: BenchSettings, hf: HFSystems, address: str, advance: Advance | None, say) -> dict:
    from specd.proto.client import channel
    from specd.bench.loadtest import _server_info
    from specd.v1 import specdecode_pb2_grpc

    n, k = settings.max_new_tokens, settings.draft_tokens
    runs: dict = {system: [] for system in SYSTEMS}
    async with channel(address) as open_channel:
        stub = specdecode_pb2_grpc.SpecDecodeStub(open_channel)
        specd = SpecdSystems(stub, settings.timeout)
        runs["server_info"] = info = await _server_info(stub, settings.timeout)
        hf_dtype = str(hf.target.dtype).removeprefix("torch.")
        if info and info["dtype"] and info["dtype"] != hf_dtype:
            say(f"warning: the orchestrator serves {info['dtype']}, the HF baselines run in {hf_dtype}: "
                "speeds and greedy_match compare unlike things")
        systems = {
            "hf_target": lambda ids, tokens: _sync(hf.run(ids, tokens, assisted=False)),
            "hf_assisted": lambda ids, tokens: _sync(hf.run(ids, tokens, assisted=True)),
            "specd_target": lambda ids, tokens: specd.run(ids, tokens, 0),
            "specd_spec": lambda ids, tokens: specd.run(ids, tokens, k),
        }
        say("warming up each system once")
        warmup_ids = hf.encode(WARMUP_PROMPT)
        for system in SYSTEMS:
            await systems[system](warmup_ids, min(n, 8))
        for index, prompt in enumerate(settings.prompts):
            prompt_ids = hf.encode(prompt)
            for system in SYSTEMS:  # interleaved: A B C D on each prompt
                runs[system].append(await systems[system](prompt_ids, n))
                if advance:
                    advance(f"prompt {index + 1}/{len(settings.prompts)} {system}")
    return runs


async def _sync(value):
    return value


# ---------------------------------------------------------------- the report


def build_report(settings: BenchSettings, runs: dict[str, list[Run]], prompt_ids: list[list[int]],
                 extra_settings: dict | None = None) -> dict:
    """The JSON report from the runs of each system (one Run per prompt, in prompt order)."""
    results = {}
    for system in SYSTEMS:
        tokens = sum(run.tokens for run in runs[system])
        seconds = sum(run.seconds for run in runs[system])
        results[system] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None}
    speed = {system: results[system]["tokens_per_s"] for system in SYSTEMS}
    ratios = {
        "specd_spec/hf_assisted": _ratio(speed["specd_spec"], speed["hf_assisted"]),
        "specd_spec/hf_target": _ratio(speed["specd_spec"], speed["hf_target"]),
        "specd_spec/specd_target": _ratio(speed["specd_spec"], speed["specd_target"]),
        "hf_assisted/hf_target": _ratio(speed["hf_assisted"], speed["hf_target"]),
        "specd_target/hf_target": _ratio(speed["specd_target"], speed["hf_target"]),
    }
    spec_stats = [run.stats for run in runs["specd_spec"]]
    drafted = sum(s["drafted"] for s in spec_stats)
    accepted = sum(s["accepted"] for s in spec_stats)
    steps = sum(s["steps"] for s in spec_stats)
    alpha = accepted / drafted if drafted else None
    draft_per_token = [s["draft_seconds"] / s["drafted"] for s in spec_stats if s["drafted"]]
    target_step = [s["verify_seconds"] / s["steps"] for s in (run.stats for run in runs["specd_target"]) if s["steps"]]
    median_draft, median_target = _median(draft_per_token), _median(target_step)
    c = _ratio(median_draft, median_target)
    best, best_k = analytic_best(alpha, c)
    per_prompt = [_prompt_entry(i, settings, runs, prompt_ids[i]) for i in range(len(settings.prompts))]
    lengths = [k for s in spec_stats for k in s.get("draft_lengths", [])]
    costs = measured_costs(spec_stats, [run.stats for run in runs["specd_target"]])
    achievable = achievable_best(alpha, costs)
    return {
        "results": results,
        "ratios": ratios,
        "median_ratios": {name: _median([r for entry in per_prompt if (r := entry["ratios"][name]) is not None])
                          for name in PROMPT_RATIOS},
        "speedup_of_analytic_best": _ratio(ratios["specd_spec/specd_target"], best),
        "measured_costs": costs,
        "achievable_speedup": achievable[0],
        "achievable_best_k": achievable[1],
        "speedup_of_achievable_best": _ratio(ratios["specd_spec/specd_target"], achievable[0]),
        "speculation_off_share": lengths.count(0) / len(lengths) if lengths else None,
        "alpha": alpha,
        "c": c,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
        "analytic_speedup": best,
        "analytic_best_k": best_k,
        "analytic_speedup_at_k": (expected_speedup(alpha, c, settings.draft_tokens)
                                  if None not in (alpha, c, settings.draft_tokens) else None),
        "median_draft_seconds_per_token": median_draft,
        "median_target_step_seconds": median_target,
        "acceptance_by_position": _acceptance_by_position(spec_stats),
        "greedy_match": all(entry["matches_hf_target"]["specd_target"] and entry["matches_hf_target"]["specd_spec"]
                            for entry in per_prompt),
        "hf_assisted_match": all(entry["matches_hf_target"]["hf_assisted"] for entry in per_prompt),
        "per_prompt": per_prompt,
        "settings": {
            "prompts": len(settings.prompts), "prompts_file": settings.prompts_file, "quick": settings.quick,
            "max_new_tokens": settings.max_new_tokens, "draft_tokens": settings.draft_tokens,
            "dtype": settings.dtype, "threads": settings.threads, "draft_model": settings.draft_model,
            "target_model": settings.target_model, "batch_size": 1, "greedy": True, "ignore_eos": True,
            "order": "interleaved per prompt: " + " ".join(SYSTEMS), "warmup": f"each system once on {WARMUP_PROMPT!r}",
            "timing": "HF: generate() wall time in process; specd: client wall time of the Generate stream",
            **(extra_settings or {}),
        },
    }


def _prompt_entry(index: int, settings: BenchSettings, runs: dict[str, list[Run]], prompt_ids: list[int]) -> dict:
    reference = runs["hf_target"][index].token_ids
    spec = runs["specd_spec"][index].stats
    off = runs["specd_target"][index].stats
    entry = {
        "index": index,
        "kind": settings.kinds[index] if index < len(settings.kinds) else "",
        "prompt": settings.prompts[index],
        "prompt_tokens": len(prompt_ids),
        "tokens_per_s": {s: runs[s][index].tokens / runs[s][index].seconds if runs[s][index].seconds else None
                         for s in SYSTEMS},
        "seconds": {s: runs[s][index].seconds for s in SYSTEMS},
        "tokens": {s: runs[s][index].tokens for s in SYSTEMS},
        "matches_hf_target": {s: runs[s][index].token_ids == reference for s in SYSTEMS if s != "hf_target"},
        "first_difference": {s: first_difference(runs[s][index].token_ids, reference)
                             for s in SYSTEMS if s != "hf_target"},
        "ratios": {name: _ratio(*(runs[s][index].tokens / runs[s][index].seconds for s in name.split("/")))
                   for name in PROMPT_RATIOS},
        "alpha": spec["accepted"] / spec["drafted"] if spec["drafted"] else None,
        "c": _ratio(_ratio(spec["draft_seconds"], spec["drafted"]), _ratio(off["verify_seconds"], off["steps"])),
        "mean_accepted_length": 1 + spec["accepted"] / spec["steps"] if spec["steps"] else None,
        "draft_lengths": spec.get("draft_lengths", []),  # K of each step: adaptive K over time (0: target-only)
        "specd_spec_stats": {key: spec[key] for key in ("steps", "drafted", "accepted", "accepted_per_position",
                                                         "draft_seconds", "verify_seconds", "other_seconds")},
        "specd_target_stats": {key: off[key] for key in ("steps", "verify_seconds", "other_seconds")},
        "hf_target_token_ids": reference,
    }
    return entry


def _acceptance_by_position(stats: list[dict]) -> list[float]:
    """For draft position i: steps whose guess i was accepted / steps that drafted a guess i."""
    from types import SimpleNamespace

    from specd.bench.loadtest import acceptance_by_position

    return acceptance_by_position([SimpleNamespace(**s) for s in stats])


def _load_average() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def _machine() -> dict:
    import torch
    import transformers

    from specd.model.loading import _cpu_flags

    flags = _cpu_flags()
    return {
        "torch": torch.__version__, "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(), "machine": platform.machine(),
        "cpu_features": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
    }


# ---------------------------------------------------------------- output


def summary_tables(report: dict) -> list:
    """Rich tables: the four systems, the speculation figures, and one row per prompt."""
    from rich.table import Table

    results, ratios = report["results"], report["ratios"]
    base = results["hf_target"]["tokens_per_s"]
    systems = Table(title=f"specd bench: {report['settings']['prompts']} prompts × {report['settings']['max_new_tokens']} "
                          f"tokens, batch 1, greedy, {report['settings'].get('dtype')}")
    for name in ("system", "what", "tokens", "seconds", "tokens/s", "vs hf_target"):
        systems.add_column(name, justify="left" if name in ("system", "what") else "right")
    for system in SYSTEMS:
        result = results[system]
        systems.add_row(system, LABELS[system], str(result["tokens"]), f"{result['seconds']:.2f}",
                        _num(result["tokens_per_s"], 2), _times(_ratio(result["tokens_per_s"], base)))

    figures = Table(title="speculation", show_header=False)
    k = report["settings"]["draft_tokens"]
    k = "auto" if k is None else k
    medians = report["median_ratios"]
    off = report["speculation_off_share"]
    rows = [
        ("specd_spec / hf_assisted", _times(ratios["specd_spec/hf_assisted"])),
        ("  median over prompts", _times(medians["specd_spec/hf_assisted"])),
        ("specd_spec / hf_target", _times(ratios["specd_spec/hf_target"])),
        ("specd_spec / specd_target", _times(ratios["specd_spec/specd_target"])),
        ("hf_assisted / hf_target", _times(ratios["hf_assisted/hf_target"])),
        (f"acceptance rate α (K = {k})", _num(report["alpha"], 3)),
        ("mean accepted length", _num(report["mean_accepted_length"], 2)),
        ("acceptance by draft position", " ".join(f"{r:.2f}" for r in report["acceptance_by_position"]) or "-"),
        ("draft s/token, target s/step (medians)",
         f"{_num(report['median_draft_seconds_per_token'], 4)} / {_num(report['median_target_step_seconds'], 4)}"),
        ("c = draft token / target step", _num(report["c"], 3)),
        (f"analytic speed-up at K = {k}", _times(report["analytic_speedup_at_k"])),
        ("analytic best speed-up (K = 1..8)",
         f"{_times(report['analytic_speedup'])} at K = {report['analytic_best_k']}" if report["analytic_best_k"] else "-"),
        ("specd_spec / specd_target, of the analytic best", _num(report["speedup_of_analytic_best"], 2)),
        ("best with the measured t_verify(K)",
         f"{_times(report['achievable_speedup'])} at K = {report['achievable_best_k']}"
         if report["achievable_best_k"] is not None else "-"),
        ("specd_spec / specd_target, of that", _num(report["speedup_of_achievable_best"], 2)),
        ("t_verify(K) / target step (measured)", _verify_curve(report["measured_costs"])),
        ("steps target-only (K chosen 0)", "-" if off is None else f"{off:.0%}"),
        ("greedy_match (specd == hf_target)", "yes" if report["greedy_match"] else "NO"),
        ("hf_assisted == hf_target", "yes" if report["hf_assisted_match"] else "no"),
    ]
    for name, value in rows:
        figures.add_row(name, value)

    prompts = Table(title="per prompt (tokens/s)")
    for name in ("#", "kind", "prompt", *SYSTEMS, "α", "mean K", "spec/target", "match"):
        prompts.add_column(name, justify="left" if name in ("kind", "prompt") else "right",
                           no_wrap=name != "prompt", max_width=24 if name == "prompt" else None)
    for entry in report["per_prompt"]:
        speed = entry["tokens_per_s"]
        matches = entry["matches_hf_target"]
        match = "yes" if matches["specd_target"] and matches["specd_spec"] else (
            "no @" + ",".join(str(entry["first_difference"][s]) for s in ("specd_target", "specd_spec")
                              if not matches[s]))
        prompts.add_row(str(entry["index"]), entry["kind"], _short(entry["prompt"]),
                        *(_num(speed[s], 2) for s in SYSTEMS), _num(entry["alpha"], 2), _mean_k(entry["draft_lengths"]),
                        _times(_ratio(speed["specd_spec"], speed["specd_target"])), match)
    return [systems, figures, prompts]


def save_plot(report: dict, path: Path | str) -> None:
    """Three panels: tokens/s per system (bars), acceptance by draft position, and K over time per prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, acceptance, lengths) = plt.subplots(1, 3, figsize=(19, 4.5))
    values = [report["results"][s]["tokens_per_s"] or 0.0 for s in SYSTEMS]
    bars = speed.bar(range(len(SYSTEMS)), values, color=["#888888", "#bbbbbb", "#4c72b0", "#dd8452"])
    speed.bar_label(bars, fmt="%.2f")
    speed.set_xticks(range(len(SYSTEMS)), SYSTEMS)
    settings = report["settings"]
    speed.set(ylabel="tokens/s", title=f"throughput ({settings['prompts']} prompts × {settings['max_new_tokens']} tokens, "
                                       f"batch 1, greedy, {settings.get('dtype')})")
    speed.grid(alpha=0.3, axis="y")
    rates = report["acceptance_by_position"]
    if rates:
        acceptance.bar(range(1, len(rates) + 1), rates, color="#dd8452")
    acceptance.set(xlabel="draft position", ylabel="accepted / steps",
                   title=f"acceptance by draft position (α = {_num(report['alpha'], 2)}, "
                         f"K = {settings['draft_tokens'] or 'auto'})",
                   xticks=range(1, max(len(rates), 1) + 1))
    acceptance.set_ylim(0, 1.05)
    acceptance.grid(alpha=0.3, axis="y")
    for entry in report["per_prompt"]:
        lengths.step(range(1, len(entry["draft_lengths"]) + 1), entry["draft_lengths"], where="post", alpha=0.6)
    lengths.set(xlabel="step", ylabel="K (0 = target-only)", title="draft length K chosen, one line per prompt")
    lengths.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _verify_curve(costs: dict) -> str:
    step = costs["target_step_s"]
    if not step:
        return "-"
    return " ".join(f"K={k}: {seconds / step:.2f}" for k, seconds in costs["verify_s_by_k"].items()) or "-"


def _mean_k(lengths: list[int]) -> str:
    return f"{sum(lengths) / len(lengths):.1f}" if lengths else "-"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _short(text: str, width: int = 24) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
