"""What a `specd loadtest --chat` report looks like (bench/chat.py builds it): two rich tables, one row
per target (`chat_summary_table`) and one per target and turn number (`chat_turn_table`), and a
figure of TTFT p50 per turn number, one line per target, beside the cache hit rate per turn number
(`save_chat_plot`). A figure the server did not report (cached tokens) is "-". Imports rich and
matplotlib only when called.
"""

import math
from pathlib import Path


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _cpu(report: dict) -> str:
    return (report["settings"].get("machine") or {}).get("cpu_model") or "unknown CPU"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _errors(errors: dict) -> str:
    return ", ".join(f"{code}×{n}" for code, n in errors.items()) or "-"


def chat_summary_table(report: dict):
    """A rich Table with one row per target: the run, turn 1 against turns 2..T, the outputs' match."""
    from rich.table import Table

    settings = report["settings"]
    title = (
        f"specd loadtest --chat: {settings['conversations']} conversations × {settings['turns']} turns, "
        f"C={settings['concurrency']}, {settings['max_new_tokens']} tokens a turn ({_cpu(report)})"
    )
    table = Table(title=title)
    last = settings["turns"]
    for name in (
        "target",
        "ok/sent",
        "tok/s",
        "TTFT p50 turn 1 ms",
        f"TTFT p50/p90 turns 2–{last} ms",
        f"cache hit turns 2–{last}",
        "α",
        "outputs vs first",
        "errors",
    ):
        table.add_column(name, justify="left" if name in ("target", "outputs vs first", "errors") else "right")
    matches = {entry["target"]: entry for entry in report.get("outputs_match", [])}
    for run in report["runs"]:
        first, later = run["per_turn"][0], run["later_turns"]
        table.add_row(
            run["target"],
            f"{run['completed']}/{run['conversations'] * run['turns']}",
            f"{run['output_tokens_per_s']:.1f}",
            _ms(first["ttft_s"]["p50"]),
            f"{_ms(later['ttft_s']['p50'])}/{_ms(later['ttft_s']['p90'])}",
            _share(run["cache_hit_rate"]),
            _num(run.get("acceptance_rate"), 2),
            _match(matches.get(run["target"])),
            _errors(run["errors"]),
        )
    return table


def _match(entry: dict | None) -> str:
    if entry is None:
        return "(reference)"
    if entry["identical"]:
        return f"identical ({entry['turns_equal']} turns)"
    first = entry["first_difference"]
    where = f", first at {first['conversation']} turn {first['turn']}" if first else ""
    return f"{entry['turns_equal']}/{entry['turns_compared']} equal{where}"


def chat_turn_table(report: dict):
    """A rich Table with one row per target and turn number (prompt and cached tokens: means per request)."""
    from rich.table import Table

    several = len(report["runs"]) > 1
    table = Table(title="per turn number")
    for name in (
        *(("target",) if several else ()),
        "turn",
        "ok/sent",
        "prompt tok",
        "cached tok",
        "hit",
        "TTFT p50/p90 ms",
        "e2e p50 s",
        "stream tok/s",
        "errors",
    ):
        table.add_column(name, justify="left" if name in ("target", "errors") else "right")
    for run in report["runs"]:
        for turn in run["per_turn"]:
            cached = turn["cached_prompt_tokens"]
            table.add_row(
                *((run["target"],) if several else ()),
                str(turn["turn"]),
                f"{turn['completed']}/{turn['requests']}",
                _num(turn["prompt_tokens_mean"], 0),
                "-" if cached is None else f"{cached / turn['cache_reported']:.0f}",
                _share(turn["cache_hit_rate"]),
                f"{_ms(turn['ttft_s']['p50'])}/{_ms(turn['ttft_s']['p90'])}",
                _num(turn["e2e_s"]["p50"], 2),
                _num(turn["stream_tokens_per_s"], 1),
                _errors(turn["errors"]),
            )
    return table


def save_chat_plot(report: dict, path: Path | str) -> None:
    """Two panels over the turn number, one line per target: TTFT p50 (p90 dotted), and the cache hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft, hits) = plt.subplots(1, 2, figsize=(13, 4.5))
    for index, run in enumerate(report["runs"]):
        color = f"C{index % 10}"
        x = [turn["turn"] for turn in run["per_turn"]]
        for quantile, style, label in (("p50", "-", run["target"]), ("p90", ":", None)):
            values = [_or_nan(turn["ttft_s"][quantile]) for turn in run["per_turn"]]
            ttft.plot(x, values, marker="o" if style == "-" else None, linestyle=style, color=color, label=label)
        rates = [_or_nan(turn["cache_hit_rate"]) for turn in run["per_turn"]]
        if not all(math.isnan(rate) for rate in rates):
            hits.plot(x, rates, marker="o", color=color, label=run["target"])
    turns = list(range(1, report["settings"]["turns"] + 1))
    ttft.set(xlabel="turn", ylabel="seconds", title="TTFT p50 per turn (p90 dotted)", xticks=turns)
    hits.set(xlabel="turn", ylabel="cached / prompt tokens", title="prefix cache hit rate per turn", xticks=turns)
    ttft.set_ylim(bottom=0)
    hits.set_ylim(0, 1.05)
    for axes in (ttft, hits):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=8)
    settings = report["settings"]
    figure.suptitle(
        f"specd loadtest --chat: {settings['conversations']} conversations × {settings['turns']} turns, "
        f"C={settings['concurrency']}, {settings['max_new_tokens']} tokens a turn ({_cpu(report)})",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value
