"""What a `specd loadtest` report looks like (bench/loadtest.py builds it): rich tables for the
terminal and matplotlib figures, per run or, in compare mode, speculative against off per
concurrency; with several targets (`--server A --openai B`), a column and one series per target.
A run of an OpenAI target has no speculation figures (α, K): "-" in the table. Imports rich and
matplotlib only when called: the load tester starts without them.
"""

import math
from pathlib import Path

import numpy as np


def run_label(run: dict) -> str:
    return f"C={run['concurrency']}" if run["concurrency"] is not None else f"{run['rate']:g} req/s"


def targets(runs: list[dict]) -> dict[str, list[dict]]:
    """The runs of each target, in the order the targets first ran (a report from before targets: one, "")."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run.get("target", ""), []).append(run)
    return groups


def summary_table(report: dict):
    """A rich Table with one row per run (latencies in milliseconds)."""
    from rich.table import Table

    several = len(targets(report["runs"])) > 1
    table = Table(title="specd loadtest")
    for name in (
        *(("target",) if several else ()),
        "run",
        "mode",
        "ok/sent",
        "tok/s",
        "req/s",
        "TTFT p50/p99 ms",
        "TPOT p50 ms",
        "ITL p50/p99 ms",
        "e2e p50/p99 s",
        "cached/prompt tok",
        "α",
        "α lookup/model",
        "lookup steps",
        "mean acc. len",
        "mean K",
        "spec off",
        "calls/pass D/T",
        "target rows/pass",
        "errors",
    ):
        table.add_column(name, justify="left" if name in ("target", "run", "errors") else "right")
    repeats = report["settings"].get("repeats", 1)
    for run in report["runs"]:
        table.add_row(*((run.get("target", ""),) if several else ()), *_table_row(run, repeats))
    return table


def _table_row(run: dict, repeats: int = 1) -> list[str]:
    errors = ", ".join(f"{code}×{n}" for code, n in run["errors"].items()) or "-"
    mode = (run.get("mode") or "-") + (f" #{run['repeat'] + 1}" if repeats > 1 else "")
    return [
        run_label(run),
        mode,
        f"{run['completed']}/{run['requests']}",
        f"{run['output_tokens_per_s']:.1f}",
        f"{run['requests_per_s']:.2f}",
        f"{_ms(run['ttft_s']['p50'])}/{_ms(run['ttft_s']['p99'])}",
        _ms(run["tpot_s"]["p50"]),
        f"{_ms(run['itl_s']['p50'])}/{_ms(run['itl_s']['p99'])}",
        f"{_num(run['e2e_s']['p50'], 2)}/{_num(run['e2e_s']['p99'], 2)}",
        f"{_num(run.get('cached_prompt_tokens'), 0)}/{_num(run.get('prompt_tokens'), 0)}",
        _num(run.get("acceptance_rate"), 2),
        *_sources(run),
        _num(run.get("mean_accepted_length"), 2),
        _num(run.get("mean_draft_length"), 1),
        "-" if run.get("speculation_off_share") is None else f"{run['speculation_off_share']:.0%}",
        f"{_num(run.get('draft_calls_per_pass'), 1)}/{_num(run.get('target_calls_per_pass'), 1)}",
        _num(run.get("target_tokens_per_pass"), 1),
        errors,
    ]


def comparison_table(report: dict):
    """A rich Table with one row per concurrency of compare mode: both modes side by side."""
    from rich.table import Table

    settings = report["settings"]
    cpu = (settings.get("machine") or {}).get("cpu_model") or "unknown CPU"
    median = f", median of {settings['repeats']} runs per mode" if settings.get("repeats", 1) > 1 else ""
    table = Table(title=f"speculative vs off ({cpu}{median})")
    for name in (
        "C",
        "spec tok/s",
        "off tok/s",
        "spec/off tok/s",
        "spec TTFT p50 ms",
        "off TTFT p50 ms",
        "spec/off TTFT",
        "α",
        "α lookup/model",
        "lookup steps",
        "mean K",
        "spec off",
        "target rows/pass spec/off",
    ):
        table.add_column(name, justify="right")
    for entry in report.get("comparison", []):
        spec, off = entry["speculative"], entry["off"]
        share = spec["speculation_off_share"]
        table.add_row(
            str(entry["concurrency"]),
            f"{spec['output_tokens_per_s']:.1f}",
            f"{off['output_tokens_per_s']:.1f}",
            _times(entry["throughput_ratio"]),
            _ms(spec["ttft_p50_s"]),
            _ms(off["ttft_p50_s"]),
            _times(entry["ttft_p50_ratio"]),
            _num(spec["acceptance_rate"], 2),
            *_sources(spec),
            _num(spec["mean_draft_length"], 1),
            "-" if share is None else f"{share:.0%}",
            f"{_num(spec['target_tokens_per_pass'], 1)}/{_num(off['target_tokens_per_pass'], 1)}",
        )
    return table


def _sources(run: dict) -> list[str]:
    """α of each source and the prompt lookup's share of the drafting steps (older reports: "-")."""
    share = run.get("lookup_step_share")
    return [
        f"{_num(run.get('lookup_acceptance_rate'), 2)}/{_num(run.get('model_acceptance_rate'), 2)}",
        "-" if share is None else f"{share:.0%}",
    ]


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def save_plot(report: dict, path: Path | str) -> None:
    """Three panels: output tokens/s, latencies, and acceptance by draft position, per run
    (a report of compare mode: `save_comparison_plot`)."""
    if report.get("comparison"):
        save_comparison_plot(report, path)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency, acceptance) = plt.subplots(1, 3, figsize=(16, 4.5))
    groups = targets(report["runs"])
    _plot_throughput(throughput, groups)
    _plot_latency(latency, groups)
    _plot_acceptance(acceptance, groups)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _x_axis(runs: list[dict]) -> tuple[list[float], str]:
    if all(run["concurrency"] is not None for run in runs):
        return [run["concurrency"] for run in runs], "concurrency"
    return [run["rate"] if run["rate"] is not None else run["concurrency"] for run in runs], "request rate (req/s)"


LATENCY_LINES = (  # (key, quantile, name, line style) of the latency panel
    ("ttft_s", "p50", "TTFT p50", "-"),
    ("tpot_s", "p50", "TPOT p50", "--"),
    ("e2e_s", "p50", "e2e p50", ":"),
    ("e2e_s", "p99", "e2e p99", "-."),
)


def _colors(groups: dict) -> dict[str, str | None]:
    """A colour per target; one target keeps matplotlib's own cycle (each latency line its colour)."""
    if len(groups) == 1:
        return dict.fromkeys(groups)
    return {name: f"C{index % 10}" for index, name in enumerate(groups)}


def _plot_throughput(axes, groups: dict[str, list[dict]]) -> None:
    ticks = set()
    for name, runs in groups.items():
        x, label = _x_axis(runs)
        axes.plot(x, [run["output_tokens_per_s"] for run in runs], marker="o", label=name or None)
        ticks |= set(x)
    axes.set(xlabel=label, ylabel="output tokens/s", title="throughput", xticks=sorted(ticks))
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    if len(groups) > 1:
        axes.legend(fontsize=8)


def _plot_latency(axes, groups: dict[str, list[dict]]) -> None:
    colors, plotted, ticks = _colors(groups), [], set()
    for name, runs in groups.items():
        x, label = _x_axis(runs)
        ticks |= set(x)
        for key, quantile, metric, style in LATENCY_LINES:
            values = [np.nan if run[key][quantile] is None else run[key][quantile] for run in runs]
            shown = f"{metric} ({name})" if len(groups) > 1 else metric
            axes.plot(x, values, marker="o", label=shown, color=colors[name], linestyle=style)
            plotted += values
    axes.set(xlabel=label, ylabel="seconds", title="latency", xticks=sorted(ticks))
    if np.nanmax(plotted + [0.0]) > 0:  # log scale needs a positive value
        axes.set_yscale("log")
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=8 if len(groups) == 1 else 6)


def _plot_acceptance(axes, groups: dict[str, list[dict]]) -> None:
    """Acceptance by draft position of each run that has one (a gRPC target's)."""
    runs = [run for group in groups.values() for run in group]
    for run in runs:
        rates = run.get("acceptance_by_position")
        if rates:
            label = run_label(run) + (f" {run['target']}" if len(groups) > 1 else "")
            axes.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    width = max((len(run.get("acceptance_by_position") or []) for run in runs), default=0)
    axes.set(
        xlabel="draft position",
        ylabel="accepted / steps",
        title="acceptance by draft position",
        xticks=range(1, width + 1),
    )
    axes.set_ylim(0, 1.05)
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()


MODE_STYLES = {
    "speculative": {"label": "speculative", "color": "#dd8452", "marker": "o"},
    "off": {"label": "speculation off (K = 0)", "color": "#4c72b0", "marker": "s"},
}
ONE_STREAM_MULTIPLE = 6  # the throughput panel's reference: this many times the off mode's single stream


def save_comparison_plot(report: dict, path: Path | str) -> None:
    """Compare mode, three panels over concurrency: output tokens/s of both modes (with a dashed
    line at 6× the off mode's single-stream throughput), TTFT p50 of both modes, and the
    speculative / off throughput ratio (line at 1.0); mean K written next to the speculative points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = report["comparison"]
    x = [entry["concurrency"] for entry in entries]
    figure, (throughput, ttft, ratio) = plt.subplots(1, 3, figsize=(17, 4.8))
    for mode, style in MODE_STYLES.items():
        throughput.plot(x, [entry[mode]["output_tokens_per_s"] for entry in entries], **style)
        ttft.plot(x, [_or_nan(entry[mode]["ttft_p50_s"]) for entry in entries], **style)
    one = next((entry for entry in entries if entry["concurrency"] == 1), None)
    if one and one["off"]["output_tokens_per_s"]:
        throughput.axhline(
            ONE_STREAM_MULTIPLE * one["off"]["output_tokens_per_s"],
            linestyle="--",
            color="gray",
            label=f"{ONE_STREAM_MULTIPLE}× one stream, off",
        )
    _mark_k(throughput, entries, [entry["speculative"]["output_tokens_per_s"] for entry in entries])
    ratios = [_or_nan(entry["throughput_ratio"]) for entry in entries]
    ratio.plot(x, ratios, color=MODE_STYLES["speculative"]["color"], marker="o", label="speculative / off")
    ratio.axhline(1.0, color="gray", linewidth=1, label="1.0 (no gain)")
    _mark_k(ratio, entries, ratios)
    throughput.set(ylabel="output tokens/s", title="throughput")
    ttft.set(ylabel="seconds", title="TTFT p50")
    ratio.set(ylabel="speculative / off", title="throughput ratio (mean K by the points)")
    for axes in (throughput, ttft, ratio):
        _concurrency_axis(axes, x)
        axes.legend(fontsize=8)
    settings = report["settings"]
    cpu = (settings.get("machine") or {}).get("cpu_model") or "unknown CPU"
    median = f", median of {settings['repeats']} runs" if settings.get("repeats", 1) > 1 else ""
    figure.suptitle(
        f"specd loadtest: speculative vs off, {settings['requests']} requests × "
        f"{settings['max_new_tokens']} tokens per run{median} ({cpu})",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _mark_k(axes, entries: list[dict], ys: list[float]) -> None:
    """Write the speculative run's mean K next to each of its points."""
    for entry, y in zip(entries, ys):
        k = entry["speculative"]["mean_draft_length"]
        if k is not None and not math.isnan(y):
            axes.annotate(
                f"K={k:.1f}", (entry["concurrency"], y), textcoords="offset points", xytext=(4, 6), fontsize=8
            )


def _concurrency_axis(axes, x: list[int]) -> None:
    from matplotlib.ticker import NullLocator

    axes.set_xscale("log", base=2)
    axes.set_xticks(x, [str(level) for level in x])
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xlabel("concurrency")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value
