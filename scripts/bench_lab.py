"""Lab benchmark: tokens/s against round-trip time and K, speculative vs speculation off.

The network lab (deploy/lab.py: draft, target and orchestrator on three namespaced hosts of one
Ray cluster; the loopback variant where namespaces are refused) with the orchestrator reaching both
services through delay proxies. For each RTT, each prompt runs with K = 0 (speculation off) and each
K, batch 1, greedy; tokens/s = completion tokens / the request's wall time at the client.

    flock /tmp/specd-heavy.lock .venv/bin/python scripts/bench_lab.py --json docs/results/lab_rtt_k.json \
        --plot docs/results/lab_rtt_k.png
"""

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from specd.cli.common import write_report
from specd.deploy.lab import Lab, LabConfig, namespaces_refused
from specd.proto.client import channel, complete, make_request
from specd.v1 import common_pb2, specdecode_pb2_grpc

PROMPTS = ("def quicksort(arr):", "# Write a function that parses an ISO 8601 date string")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtts", default="0,1,5,20,50", help="round-trip times in ms (comma-separated)")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="draft lengths K to try")
    parser.add_argument("--prompts", type=int, default=1, help=f"how many of {len(PROMPTS)} prompts")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--draft-model", default="draft")
    parser.add_argument("--target-model", default="target")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft-quantize", default="auto", help="as `specd up`: auto = int4 for a CPU draft")
    parser.add_argument("--loopback", action="store_true", help="the loopback lab even where namespaces work")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw --plot from a saved report")
    return parser.parse_args()


async def run(args, console: Console) -> dict:
    rtts = [float(rtt) for rtt in args.rtts.split(",")]
    ks = [0] + [int(k) for k in args.ks.split(",")]
    prompts = PROMPTS[: args.prompts]
    refused = None if args.loopback else namespaces_refused()
    if refused:
        console.print(f"[yellow]network namespaces refused ({refused}): the loopback lab instead")
    config = LabConfig(
        draft_model=args.draft_model,
        target_model=args.target_model,
        dtype=args.dtype,
        namespaces=not (args.loopback or refused),
        up_flags=["--draft-quantize", args.draft_quantize],
    )
    started = time.monotonic()
    async with Lab(config, say=console.print) as lab:
        await lab.deploy()
        console.print(f"stack deployed in {time.monotonic() - started:.0f} s: {lab.deployed}")
        async with channel(lab.address) as orchestrator:
            stub = specdecode_pb2_grpc.SpecDecodeStub(orchestrator)
            await complete(stub, make_request(prompts[0], 8, draft_tokens=4, ignore_eos=True))  # warm-up
            info = await stub.Info(common_pb2.InfoRequest())
            partial = args.json.with_suffix(".partial.json") if args.json else None
            runs = await sweep(lab, stub, rtts, ks, prompts, args.max_new_tokens, partial)
    return {
        "lab": "namespaces" if config.namespaces else "loopback",
        "dtype": args.dtype,
        "models": {
            role: {"model": part.model, "dtype": part.dtype, "quantization": part.quantization}
            for role, part in (("draft", info.draft), ("target", info.target))
        },
        "max_new_tokens": args.max_new_tokens,
        "prompts": list(prompts),
        "rtts_ms": rtts,
        "ks": ks,
        "wall_s": round(time.monotonic() - started, 1),
        "runs": runs,
        "summary": summarize(runs, rtts),
    }


async def sweep(lab: Lab, stub, rtts, ks, prompts, max_new_tokens, partial: Path | None) -> list[dict]:
    runs = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns) as progress:
        task = progress.add_task("sweep", total=len(rtts) * len(ks) * len(prompts))
        for rtt in rtts:
            lab.set_rtt(rtt)
            for prompt_index, prompt in enumerate(prompts):
                off_tokens = None
                for k in ks:
                    progress.update(task, description=f"RTT {rtt:g} ms, prompt {prompt_index}, K={k}")
                    started = time.perf_counter()
                    done = await complete(stub, make_request(prompt, max_new_tokens, draft_tokens=k, ignore_eos=True))
                    seconds = time.perf_counter() - started
                    off_tokens = done.token_ids if k == 0 else off_tokens
                    stats = done.final.stats
                    runs.append(
                        {
                            "rtt_ms": rtt,
                            "prompt": prompt_index,
                            "k": k,
                            "seconds": round(seconds, 3),
                            "tokens": len(done.token_ids),
                            "tokens_per_s": round(len(done.token_ids) / seconds, 3),
                            "acceptance_rate": round(stats.acceptance_rate, 3),
                            "steps": stats.steps,
                            "network_seconds": round(stats.network_seconds, 3),
                            "equals_speculation_off": done.token_ids == off_tokens,
                        }
                    )
                    progress.advance(task)
            if partial:  # a run cut short keeps what it measured
                partial.write_text(json.dumps(runs, indent=1) + "\n")
    return runs


def summarize(runs: list[dict], rtts: list[float]) -> list[dict]:
    """Per RTT: tokens/s with speculation off and at each K (summed over prompts), the best K, its speed-up."""
    rows = []
    for rtt in rtts:
        at_rtt = [run for run in runs if run["rtt_ms"] == rtt]
        by_k = {}
        for k in sorted({run["k"] for run in at_rtt}):
            of_k = [run for run in at_rtt if run["k"] == k]
            by_k[k] = sum(run["tokens"] for run in of_k) / sum(run["seconds"] for run in of_k)
        off = by_k.pop(0)
        best_k = max(by_k, key=by_k.get)
        rows.append(
            {
                "rtt_ms": rtt,
                "off_tokens_per_s": round(off, 3),
                "tokens_per_s_by_k": {k: round(value, 3) for k, value in by_k.items()},
                "best_k": best_k,
                "best_tokens_per_s": round(by_k[best_k], 3),
                "best_speedup": round(by_k[best_k] / off, 3),
            }
        )
    return rows


def print_summary(report: dict, console: Console) -> None:
    table = Table(title=f"tokens/s by RTT and K ({report['lab']} lab, {report['dtype']}, {report['wall_s']:.0f} s)")
    ks = report["ks"][1:]
    for header in ["RTT ms", "off", *(f"K={k}" for k in ks), "best K", "speed-up"]:
        table.add_column(header, justify="right")
    for row in report["summary"]:
        by_k = row["tokens_per_s_by_k"]
        table.add_row(
            f"{row['rtt_ms']:g}",
            f"{row['off_tokens_per_s']:.2f}",
            *(f"{by_k[k]:.2f}" for k in ks),
            str(row["best_k"]),
            f"{row['best_speedup']:.2f}×",
        )
    console.print(table)
    mismatched = [run for run in report["runs"] if not run["equals_speculation_off"]]
    console.print(
        f"{len(mismatched)} of {len(report['runs'])} runs differ from speculation off "
        "(bf16: batched scoring may round differently)"
    )


def save_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_k, speedup) = plt.subplots(1, 2, figsize=(12, 4.5))
    ks = report["ks"][1:]
    summary = report["summary"]
    for row in summary:
        measured = {int(k): value for k, value in row["tokens_per_s_by_k"].items()}  # JSON keys are strings
        (line,) = by_k.plot(ks, [measured[k] for k in ks], marker="o", label=f"RTT {row['rtt_ms']:g} ms")
        by_k.axhline(row["off_tokens_per_s"], color=line.get_color(), linestyle="--", linewidth=1)
    by_k.set(xlabel="K (draft tokens per step)", ylabel="tokens/s", title="speculative (solid) vs off (dashed)")
    by_k.legend()
    rtts = [row["rtt_ms"] for row in summary]
    speedup.plot(rtts, [row["best_speedup"] for row in summary], marker="o")
    for row in summary:
        speedup.annotate(
            f"K={row['best_k']}",
            (row["rtt_ms"], row["best_speedup"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
        )
    speedup.axhline(1.0, color="grey", linestyle=":")
    speedup.set_xscale("symlog", linthresh=1)
    speedup.set_xlim(0, max(rtts) * 1.5)
    speedup.margins(y=0.15)
    speedup.set(xlabel="round-trip time, ms", ylabel="best speculative / off", title="speed-up at the best K")
    figure.suptitle(
        f"specd network lab ({report['lab']}, {report['dtype']}, {len(report['prompts'])} prompt(s) x "
        f"{report['max_new_tokens']} tokens)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` tears the lab down like Ctrl-C
    args = parse_args()
    console = Console()
    if args.replot:
        save_plot(json.loads(args.replot.read_text()), args.plot)
        return
    report = asyncio.run(run(args, console))
    print_summary(report, console)
    write_report(console, report, args.json, args.plot, save_plot)


if __name__ == "__main__":
    main()
