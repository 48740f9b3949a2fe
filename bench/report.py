"""What a `specd bench` report looks like (figures.py builds it): rich tables for the terminal
(`summary_tables`: the systems, the speculation figures, one row per prompt) and a matplotlib
figure (`save_plot`). Imports rich and matplotlib only when called, and neither torch nor gRPC:
a machine without them can print and plot a saved report. The report's maths and its building
are importable from here too (`__all__`), where the callers have always found them.
"""

from __future__ import annotations

from pathlib import Path

from specd.bench.figures import SYSTEMS, analytic_best, build_report, expected_speedup, first_difference, ratio

__all__ = [
    "SYSTEMS",
    "analytic_best",
    "build_report",
    "expected_speedup",
    "first_difference",
    "save_plot",
    "summary_tables",
]

COLORS = {
    "hf_target": "#888888",
    "hf_assisted": "#bbbbbb",
    "hf_lookup": "#8fbc8f",
    "specd_target": "#4c72b0",
    "specd_spec": "#dd8452",
}
LABELS = {
    "hf_target": "HF target only",
    "hf_assisted": "HF assisted (assistant_model)",
    "hf_lookup": "HF prompt lookup (prompt_lookup_num_tokens)",
    "specd_target": "specd, K = 0 (target only)",
    "specd_spec": "specd speculative",
}
PEER_COLORS = ("#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#64b5cd")


def summary_tables(report: dict) -> list:
    """Rich tables: the systems, the speculation figures, and one row per prompt."""
    from rich.table import Table

    results, ratios = report["results"], report["ratios"]
    shown = _shown(report)
    base = results["hf_target"]["tokens_per_s"]
    settings = report["settings"]
    systems = Table(
        title=f"specd bench: {settings['prompts']} prompts × {settings['max_new_tokens']} "
        f"tokens, batch 1, greedy, {settings.get('dtype')}"
    )
    for name in ("system", "what", "tokens", "seconds", "tokens/s", "vs hf_target"):
        systems.add_column(name, justify="left" if name in ("system", "what") else "right")
    for system in shown:
        result = results[system]
        systems.add_row(
            system,
            LABELS.get(system) or f"OpenAI-compatible peer, {settings.get('peers', {}).get(system, '?')}",
            str(result["tokens"]),
            f"{result['seconds']:.2f}",
            _num(result["tokens_per_s"], 2),
            _times(ratio(result["tokens_per_s"], base)),
        )

    figures = Table(title="speculation", show_header=False)
    k = "auto" if settings["draft_tokens"] is None else settings["draft_tokens"]
    medians = report["median_ratios"]
    off = report["speculation_off_share"]
    rows = [
        ("specd_spec / hf_assisted", _times(ratios["specd_spec/hf_assisted"])),
        ("  median over prompts", _times(medians["specd_spec/hf_assisted"])),
        ("specd_spec / hf_best (faster of hf_assisted, hf_lookup)", _times(ratios.get("specd_spec/hf_best"))),
        ("  median over prompts (faster on each prompt)", _times(medians.get("specd_spec/hf_best"))),
        ("specd_spec / hf_lookup", _times(ratios.get("specd_spec/hf_lookup"))),
        ("specd_spec / hf_target", _times(ratios["specd_spec/hf_target"])),
        ("specd_spec / specd_target", _times(ratios["specd_spec/specd_target"])),
        ("hf_assisted / hf_target", _times(ratios["hf_assisted/hf_target"])),
        ("hf_lookup / hf_target", _times(ratios.get("hf_lookup/hf_target"))),
        (f"acceptance rate α (K = {k})", _num(report["alpha"], 3)),
        ("mean accepted length", _num(report["mean_accepted_length"], 2)),
        ("acceptance by draft position", " ".join(f"{r:.2f}" for r in report["acceptance_by_position"]) or "-"),
        (
            "draft s/token, target s/step (medians)",
            f"{_num(report['median_draft_seconds_per_token'], 4)} / {_num(report['median_target_step_seconds'], 4)}",
        ),
        ("c = draft token / target step", _num(report["c"], 3)),
        (f"analytic speed-up at K = {k}", _times(report["analytic_speedup_at_k"])),
        (
            "analytic best speed-up (K = 1..8)",
            f"{_times(report['analytic_speedup'])} at K = {report['analytic_best_k']}"
            if report["analytic_best_k"]
            else "-",
        ),
        ("specd_spec / specd_target, of the analytic best", _num(report["speedup_of_analytic_best"], 2)),
        (
            "best with the measured t_verify(K)",
            f"{_times(report['achievable_speedup'])} at K = {report['achievable_best_k']}"
            if report["achievable_best_k"] is not None
            else "-",
        ),
        ("specd_spec / specd_target, of that", _num(report["speedup_of_achievable_best"], 2)),
        ("t_verify(K) / target step (measured)", _verify_curve(report["measured_costs"])),
        ("steps target-only (K chosen 0)", "-" if off is None else f"{off:.0%}"),
        ("greedy_match (specd == hf_target)", "yes" if report["greedy_match"] else "NO"),
        ("hf_assisted == hf_target", "yes" if report["hf_assisted_match"] else "no"),
        ("hf_lookup == hf_target", _yes_no(report.get("hf_lookup_match"))),
    ]
    for peer, checks in report.get("peers", {}).items():
        rows += [
            (f"specd_spec / {peer}", _times(ratios.get(f"specd_spec/{peer}"))),
            (f"  median over prompts ({peer})", _times(medians.get(f"specd_spec/{peer}"))),
            (f"{peer} text == specd_target", _yes_no(checks["matches_specd_target"])),
            (f"{peer} tokens == specd_target's", _yes_no(checks["same_token_counts"])),
        ]
    for name, value in rows:
        figures.add_row(name, value)

    prompts = Table(title="per prompt (tokens/s)")
    for name in ("#", "kind", "prompt", *shown, "α", "mean K", "spec/target", "spec/hf_best", "match"):
        prompts.add_column(
            name,
            justify="left" if name in ("kind", "prompt") else "right",
            no_wrap=name != "prompt",
            max_width=24 if name == "prompt" else None,
        )
    for entry in report["per_prompt"]:
        speed = entry["tokens_per_s"]
        matches = entry["matches_hf_target"]
        match = (
            "yes"
            if matches["specd_target"] and matches["specd_spec"]
            else (
                "no @"
                + ",".join(str(entry["first_difference"][s]) for s in ("specd_target", "specd_spec") if not matches[s])
            )
        )
        prompts.add_row(
            str(entry["index"]),
            entry["kind"],
            _short(entry["prompt"]),
            *(_num(speed[s], 2) for s in shown),
            _num(entry["alpha"], 2),
            _mean_k(entry["draft_lengths"]),
            _times(ratio(speed["specd_spec"], speed["specd_target"])),
            _times(entry["ratios"].get("specd_spec/hf_best")),
            match,
        )
    return [systems, figures, prompts]


def save_plot(report: dict, path: Path | str) -> None:
    """Three panels: tokens/s per system (bars), acceptance by draft position, and K over time per prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, acceptance, lengths) = plt.subplots(1, 3, figsize=(19, 4.5))
    shown = _shown(report)
    values = [report["results"][s]["tokens_per_s"] or 0.0 for s in shown]
    bars = speed.bar(range(len(shown)), values, color=[_color(s, report) for s in shown])
    speed.bar_label(bars, fmt="%.2f")
    speed.set_xticks(range(len(shown)), shown)
    settings = report["settings"]
    speed.set(
        ylabel="tokens/s",
        title=f"throughput ({settings['prompts']} prompts × {settings['max_new_tokens']} "
        f"tokens, batch 1, greedy, {settings.get('dtype')})",
    )
    speed.grid(alpha=0.3, axis="y")
    rates = report["acceptance_by_position"]
    if rates:
        acceptance.bar(range(1, len(rates) + 1), rates, color="#dd8452")
    acceptance.set(
        xlabel="draft position",
        ylabel="accepted / steps",
        title=f"acceptance by draft position (α = {_num(report['alpha'], 2)}, "
        f"K = {settings['draft_tokens'] or 'auto'})",
        xticks=range(1, max(len(rates), 1) + 1),
    )
    acceptance.set_ylim(0, 1.05)
    acceptance.grid(alpha=0.3, axis="y")
    for entry in report["per_prompt"]:
        lengths.step(range(1, len(entry["draft_lengths"]) + 1), entry["draft_lengths"], where="post", alpha=0.6)
    lengths.set(xlabel="step", ylabel="K (0 = target-only)", title="draft length K chosen, one line per prompt")
    lengths.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _shown(report: dict) -> list[str]:
    """The systems the report has, in SYSTEMS order (a report written before hf_lookup has four), then the peers."""
    return [system for system in SYSTEMS if system in report["results"]] + list(report.get("peers", {}))


def _color(system: str, report: dict) -> str:
    if system in COLORS:
        return COLORS[system]
    return PEER_COLORS[list(report.get("peers", {})).index(system) % len(PEER_COLORS)]


def _verify_curve(costs: dict) -> str:
    step = costs["target_step_s"]
    if not step:
        return "-"
    return " ".join(f"K={k}: {seconds / step:.2f}" for k, seconds in costs["verify_s_by_k"].items()) or "-"


def _mean_k(lengths: list[int]) -> str:
    return f"{sum(lengths) / len(lengths):.1f}" if lengths else "-"


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _short(text: str, width: int = 24) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
