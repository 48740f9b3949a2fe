"""The figures of a load test's runs, from the RequestResult of each request (workload.py):
pure bookkeeping, no network.

Per run (`summarize_run`; docs/architecture.md §2 words): TTFT (request start to the first delta
that carries tokens), TPOT ((e2e - TTFT) / (completion tokens - 1)), inter-token latency (each
token of a delta gets the gap since the previous delta divided by the tokens the delta carried),
end-to-end latency, each as mean/p50/p90/p99; output tokens/s and requests/s over the run's wall
time; errors by gRPC status code name; acceptance rate α = accepted / drafted; mean accepted
length 1 + accepted / steps; and acceptance by draft position (steps whose draft token i was
accepted / steps that drafted position i). Beside these names, each run has its figures under
vLLM `bench serve`'s names (`vllm_fields`: `output_throughput`, `mean_ttft_ms`, `p99_itl_ms`,
`e2el`, `generated_texts`, ...). `calls_per_pass`: how much the services batched during a run.

Compare mode (`comparison`): per concurrency, each mode's median-throughput run of its repeats
(the lower middle one for an even count), and the ratios speculative / off of output tokens/s and
of TTFT p50.
"""

from collections import Counter

import numpy as np

from specd.bench.workload import RequestResult
from specd.v1 import specdecode_pb2

MODES = ("speculative", "off")  # compare mode's two runs per concurrency, in the order of its first pair


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
        **prompt_tokens(done),
        "requests_per_s": len(done) / wall if wall > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl_s": percentiles([x for r in done for x in inter_token_latencies(r.delta_times, r.delta_tokens)]),
        "e2e_s": percentiles([r.e2e for r in done]),
        **speculative,
        "errors": dict(sorted(Counter(r.error for r in results if not r.ok).items())),
        **vllm_fields(results, wall),
    }


def prompt_tokens(done: list[RequestResult]) -> dict:
    """The prompt tokens the server counted over the run's completed requests, and of those the ones
    it served from its prefix cache (None: no request's server said)."""
    said = [r.cached_prompt_tokens for r in done if r.cached_prompt_tokens is not None]
    counted = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {"prompt_tokens": sum(counted) if counted else None, "cached_prompt_tokens": sum(said) if said else None}


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
