"""The peer benchmark's figures: the maths and the JSON report (its tables and plot: report.py).

Pure bookkeeping over finished runs (no torch, no model, no network): `build_report` takes, for
each system of SYSTEMS, one run per prompt (anything with `token_ids`, `seconds` and, for the
specd systems, `stats`, specd's SpeculationStats as a dict: `specd.bench.systems.Run`) and
returns the report `specd bench` prints, writes and plots. Running the systems is
`specd.bench.systems`; printing and plotting the report, `specd.bench.report`.

Figures (docs/architecture.md §2 words): tokens/s = total tokens / total seconds over the prompts;
α = accepted / drafted and mean accepted length = 1 + accepted / steps, from specd's final
stats; c = median over prompts of specd_spec's draft seconds per drafted token / median of
specd_target's seconds per decode step (both include their gRPC round trip); the analytic
best speed-up = max over K = 1..8 of (1 - α^(K+1)) / ((1 - α)(K·c + 1)); the achievable best
uses the measured Verify time of each K instead of one step; greedy_match = both specd outputs
equal hf_target's token ids on every prompt (`hf_assisted_match`, `hf_lookup_match`: the same for
each HF peer). `specd_spec/hf_best` compares specd_spec with the faster HF speculative peer,
hf_assisted or hf_lookup: over all tokens the faster of the two totals, per prompt (and so in
`median_ratios`) the faster of the two on that prompt. Per prompt the report also has the K of
every step (adaptive K over time; 0 = target-only), α and c, and the per-prompt ratios whose
medians are `median_ratios`.

Peers (settings.peers, `specd bench --peer NAME=URL`: OpenAI-compatible servers) are systems of their
own after SYSTEMS, in `results`, `per_prompt` and the plot, with the ratios `specd_spec/NAME` and
`NAME/hf_target`. A peer answers text, not token ids: `peers[NAME]` says whether its text equals
specd_target's on every prompt (`matches_specd_target`; per prompt: `peer_matches_specd_target`) and
whether it made as many tokens as specd_target (`same_token_counts`, by the server's own count).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specd.bench.systems import BenchSettings, Run

SYSTEMS = ("hf_target", "hf_assisted", "hf_lookup", "specd_target", "specd_spec")
HF_SPECULATIVE = ("hf_assisted", "hf_lookup")  # the HF peers that speculate: hf_best is the faster of them
ANALYTIC_MAX_K = 8
PROMPT_RATIOS = (
    "specd_spec/hf_assisted",
    "specd_spec/specd_target",
    "specd_spec/hf_target",
    "hf_assisted/hf_target",
    "specd_spec/hf_lookup",
    "specd_spec/hf_best",
    "hf_lookup/hf_target",
)


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
    steps = [
        (k, draft, verify)
        for s in spec_stats
        for k, draft, verify in zip(
            s.get("draft_lengths", []), s.get("step_draft_seconds", []), s.get("step_verify_seconds", [])
        )
    ]
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

    speedups = {
        0: 1.0,
        **{k: expected_tokens(alpha, k) * step / (k * draft + verify) for k, verify in costs["verify_s_by_k"].items()},
    }
    k = max(speedups, key=speedups.get)
    return speedups[k], k


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None where either is unknown or the denominator is 0."""
    return numerator / denominator if numerator is not None and denominator else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _best(speeds: list[float | None]) -> float | None:
    """The fastest of the known speeds (None when none is known)."""
    known = [speed for speed in speeds if speed is not None]
    return max(known) if known else None


def _speed(run: Run) -> float | None:
    return run.tokens / run.seconds if run.seconds else None


# ---------------------------------------------------------------- the report


def peer_ratios(peers) -> tuple[str, ...]:
    """The ratios each peer gets: specd_spec against it, and it against hf_target."""
    return tuple(name for peer in peers for name in (f"specd_spec/{peer}", f"{peer}/hf_target"))


def build_report(
    settings: BenchSettings, runs: dict[str, list[Run]], prompt_ids: list[list[int]], extra_settings: dict | None = None
) -> dict:
    """The JSON report from the runs of each system (one Run per prompt, in prompt order).

    `prompt_ids`: each prompt's token ids; `extra_settings`: more entries for report["settings"]
    (how the runs were made: machine, dtype served, order, ...).
    """
    peers = list(getattr(settings, "peers", None) or {})
    results = {}
    for system in (*SYSTEMS, *peers):
        tokens = sum(run.tokens for run in runs[system])
        seconds = sum(run.seconds for run in runs[system])
        results[system] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None}
    speed = {system: results[system]["tokens_per_s"] for system in results}
    speed["hf_best"] = _best([speed[system] for system in HF_SPECULATIVE])
    ratios = {
        "specd_spec/hf_assisted": ratio(speed["specd_spec"], speed["hf_assisted"]),
        "specd_spec/hf_target": ratio(speed["specd_spec"], speed["hf_target"]),
        "specd_spec/specd_target": ratio(speed["specd_spec"], speed["specd_target"]),
        "hf_assisted/hf_target": ratio(speed["hf_assisted"], speed["hf_target"]),
        "specd_target/hf_target": ratio(speed["specd_target"], speed["hf_target"]),
        "specd_spec/hf_lookup": ratio(speed["specd_spec"], speed["hf_lookup"]),
        "specd_spec/hf_best": ratio(speed["specd_spec"], speed["hf_best"]),
        "hf_lookup/hf_target": ratio(speed["hf_lookup"], speed["hf_target"]),
        **{name: ratio(*(speed[s] for s in name.split("/"))) for name in peer_ratios(peers)},
    }
    spec_stats = [run.stats for run in runs["specd_spec"]]
    drafted = sum(s["drafted"] for s in spec_stats)
    accepted = sum(s["accepted"] for s in spec_stats)
    steps = sum(s["steps"] for s in spec_stats)
    alpha = accepted / drafted if drafted else None
    # the draft model's time per guess: the prompt lookup's guesses (lookup_drafted) took none
    model_drafted = [s["drafted"] - s.get("lookup_drafted", 0) for s in spec_stats]
    draft_per_token = [s["draft_seconds"] / n for s, n in zip(spec_stats, model_drafted) if n]
    target_step = [s["verify_seconds"] / s["steps"] for s in (run.stats for run in runs["specd_target"]) if s["steps"]]
    median_draft, median_target = _median(draft_per_token), _median(target_step)
    c = ratio(median_draft, median_target)
    best, best_k = analytic_best(alpha, c)
    per_prompt = [_prompt_entry(i, settings, runs, prompt_ids[i], peers) for i in range(len(settings.prompts))]
    lengths = [k for s in spec_stats for k in s.get("draft_lengths", [])]
    costs = measured_costs(spec_stats, [run.stats for run in runs["specd_target"]])
    achievable = achievable_best(alpha, costs)
    return {
        "results": results,
        "ratios": ratios,
        "median_ratios": {
            name: _median([r for entry in per_prompt if (r := entry["ratios"][name]) is not None])
            for name in (*PROMPT_RATIOS, *peer_ratios(peers))
        },
        "speedup_of_analytic_best": ratio(ratios["specd_spec/specd_target"], best),
        "measured_costs": costs,
        "achievable_speedup": achievable[0],
        "achievable_best_k": achievable[1],
        "speedup_of_achievable_best": ratio(ratios["specd_spec/specd_target"], achievable[0]),
        "speculation_off_share": lengths.count(0) / len(lengths) if lengths else None,
        "alpha": alpha,
        "c": c,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
        "analytic_speedup": best,
        "analytic_best_k": best_k,
        "analytic_speedup_at_k": (
            expected_speedup(alpha, c, settings.draft_tokens) if None not in (alpha, c, settings.draft_tokens) else None
        ),
        "median_draft_seconds_per_token": median_draft,
        "median_target_step_seconds": median_target,
        "acceptance_by_position": _acceptance_by_position(spec_stats),
        "by_source": by_source(spec_stats),
        "greedy_match": all(
            entry["matches_hf_target"]["specd_target"] and entry["matches_hf_target"]["specd_spec"]
            for entry in per_prompt
        ),
        "hf_assisted_match": all(entry["matches_hf_target"]["hf_assisted"] for entry in per_prompt),
        "hf_lookup_match": all(entry["matches_hf_target"]["hf_lookup"] for entry in per_prompt),
        "peers": {
            peer: {
                "matches_specd_target": all(entry["peer_matches_specd_target"][peer] for entry in per_prompt),
                "same_token_counts": all(
                    entry["tokens"][peer] == entry["tokens"]["specd_target"] for entry in per_prompt
                ),
            }
            for peer in peers
        },
        "per_prompt": per_prompt,
        "settings": {
            "prompts": len(settings.prompts),
            "prompts_file": settings.prompts_file,
            "quick": settings.quick,
            "max_new_tokens": settings.max_new_tokens,
            "draft_tokens": settings.draft_tokens,
            "drafter": settings.drafter or "server default",
            "lookup_tokens": settings.lookup_tokens,  # hf_lookup's prompt_lookup_num_tokens
            "dtype": settings.dtype,
            "device": settings.target.device or "auto",
            "draft_device": settings.draft.device or "auto",
            "cuda_graphs": {"draft": settings.draft.cuda_graphs, "target": settings.target.cuda_graphs},
            "engine": {"draft": settings.draft.engine, "target": settings.target.engine},
            "threads": settings.threads,
            "draft_model": settings.draft.model,
            "target_model": settings.target.model,
            "peers": dict(getattr(settings, "peers", None) or {}),  # name -> URL
            "batch_size": 1,
            "greedy": True,
            "ignore_eos": True,
            **(extra_settings or {}),
        },
    }


def _prompt_entry(
    index: int, settings: BenchSettings, runs: dict[str, list[Run]], prompt_ids: list[int], peers: list[str] = ()
) -> dict:
    reference = runs["hf_target"][index].token_ids
    spec = runs["specd_spec"][index].stats
    off = runs["specd_target"][index].stats
    systems = (*SYSTEMS, *peers)
    speed = {s: _speed(runs[s][index]) for s in systems}
    speed["hf_best"] = _best([speed[s] for s in HF_SPECULATIVE])
    entry = {
        "index": index,
        "kind": settings.kinds[index] if index < len(settings.kinds) else "",
        "prompt": settings.prompts[index],
        "prompt_tokens": len(prompt_ids),
        "tokens_per_s": {s: speed[s] for s in systems},
        "seconds": {s: runs[s][index].seconds for s in systems},
        "tokens": {s: runs[s][index].tokens for s in systems},
        "matches_hf_target": {s: runs[s][index].token_ids == reference for s in SYSTEMS if s != "hf_target"},
        "first_difference": {
            s: first_difference(runs[s][index].token_ids, reference) for s in SYSTEMS if s != "hf_target"
        },
        "ratios": {name: ratio(*(speed[s] for s in name.split("/"))) for name in (*PROMPT_RATIOS, *peer_ratios(peers))},
        "hf_best": max(HF_SPECULATIVE, key=lambda s: -1.0 if speed[s] is None else speed[s]),  # the faster HF peer
        "alpha": spec["accepted"] / spec["drafted"] if spec["drafted"] else None,
        "c": ratio(ratio(spec["draft_seconds"], spec["drafted"]), ratio(off["verify_seconds"], off["steps"])),
        "mean_accepted_length": 1 + spec["accepted"] / spec["steps"] if spec["steps"] else None,
        "draft_lengths": spec.get("draft_lengths", []),  # K of each step: adaptive K over time (0: target-only)
        "specd_spec_stats": {
            key: spec[key]
            for key in (
                "steps",
                "drafted",
                "accepted",
                "accepted_per_position",
                "draft_seconds",
                "verify_seconds",
                "other_seconds",
            )
        },
        "specd_target_stats": {key: off[key] for key in ("steps", "verify_seconds", "other_seconds")},
        "hf_target_token_ids": reference,
    }
    if peers:  # a peer's text against specd_target's (a peer returns no token ids)
        target_text = runs["specd_target"][index].text
        entry["peer_matches_specd_target"] = {peer: runs[peer][index].text == target_text for peer in peers}
    return entry


def by_source(spec_stats: list[dict]) -> dict:
    """specd_spec's drafting steps by who guessed (the prompt lookup, the draft model): steps,
    guesses, accepted, α and tokens per step (accepted + the target's own)."""
    lookup = {name: sum(s.get(f"lookup_{name}", 0) for s in spec_stats) for name in ("steps", "drafted", "accepted")}
    total = {
        "steps": sum(s.get("drafting_steps", 0) for s in spec_stats),
        "drafted": sum(s["drafted"] for s in spec_stats),
        "accepted": sum(s["accepted"] for s in spec_stats),
    }
    model = {name: total[name] - lookup[name] for name in total}
    return {
        source: {
            **counts,
            "alpha": ratio(counts["accepted"], counts["drafted"]),
            "tokens_per_step": 1 + counts["accepted"] / counts["steps"] if counts["steps"] else None,
        }
        for source, counts in (("lookup", lookup), ("model", model))
    }


def _acceptance_by_position(stats: list[dict]) -> list[float]:
    """For draft position i: steps whose guess i was accepted / steps that drafted a guess i."""
    from types import SimpleNamespace

    from specd.bench.loadtest_stats import acceptance_by_position

    return acceptance_by_position([SimpleNamespace(**s) for s in stats])
