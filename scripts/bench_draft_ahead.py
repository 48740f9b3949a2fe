"""Lab benchmark: tokens/s synchronous vs draft-ahead against round-trip time, draft and target on separate cores.

The network lab (deploy/lab.py) on namespaced hosts pinned to CPUs of their own (split_cores: the
target half the cores, the draft and the orchestrator the rest), the orchestrator reaching both
services through delay proxies. For each RTT, each prompt runs `--runs` times with draft-ahead off
(synchronous: Propose, wait, Verify, wait) and on, at a fixed K, batch 1, greedy, alternating which
goes first; tokens/s = completion tokens / the request's wall time at the client. Beside each cell,
the analytic expectation (adaptive.py draft_ahead_gain) from the synchronous runs' own measured
draft and verify times, round trips and α, and the draft-ahead runs' bonus-match rate β.

    flock /tmp/specd-heavy.lock .venv/bin/python scripts/bench_draft_ahead.py   # docs/results/draft_ahead_<cpu>.*
    .venv/bin/python scripts/bench_draft_ahead.py --tiny --rtts 0,20 --runs 1 --max-new-tokens 12 --json /tmp/a.json
"""

import argparse
import asyncio
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specd.bench.loadtest import cpu_tag
from specd.cli.common import write_report
from specd.deploy.lab import Lab, LabConfig, namespaces_refused, split_cores
from specd.orchestrator.adaptive import draft_ahead_gain, expected_tokens
from specd.proto.client import channel, complete, make_request
from specd.v1 import common_pb2, specdecode_pb2_grpc

PROMPTS = (
    "def quicksort(arr):",
    "# Write a function that parses an ISO 8601 date string",
    "class LRUCache:\n    def __init__(self, capacity: int):",
)
MODES = ("off", "on")  # draft_ahead of each run: synchronous, then drafting ahead


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtts", default="0,5,20,50", help="round-trip times in ms (comma-separated)")
    parser.add_argument("--k", type=int, default=4, help="draft length K of every step")
    parser.add_argument("--prompts", type=int, default=2, help=f"how many of {len(PROMPTS)} prompts")
    parser.add_argument("--runs", type=int, default=2, help="runs per prompt, mode and RTT")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-model", default="draft")
    parser.add_argument("--target-model", default="target")
    parser.add_argument("--dtype", default=None, help="as `specd up` (default: the services' own)")
    parser.add_argument("--draft-quantize", default="auto", help="as `specd up`: auto = int4 for a CPU draft")
    parser.add_argument("--tiny", action="store_true", help="tiny random models (a smoke run of the script)")
    parser.add_argument("--json", type=Path, help="default docs/results/draft_ahead_<cpu>.json")
    parser.add_argument("--plot", type=Path, help="default: the --json path as .png")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw --plot from a saved report")
    args = parser.parse_args()
    if args.json is None:
        args.json = Path(f"docs/results/draft_ahead_{cpu_tag()}.json")
    args.plot = args.plot or args.json.with_suffix(".png")
    return args


async def run(args, console: Console) -> dict:
    rtts = [float(rtt) for rtt in args.rtts.split(",")]
    prompts = PROMPTS[: args.prompts]
    refused = namespaces_refused()
    cpus = {} if refused else split_cores()
    if refused:
        console.print(f"[yellow]network namespaces refused ({refused}): loopback lab, draft and target share cores")
    models = tiny_models() if args.tiny else {"draft": args.draft_model, "target": args.target_model}
    threads = min((len(cpu_list.split(",")) for cpu_list in cpus.values()), default=None)
    config = LabConfig(
        draft_model=models["draft"],
        target_model=models["target"],
        dtype="float32" if args.tiny else args.dtype,
        namespaces=not refused,
        cpus=cpus,
        up_flags=["--draft-quantize", args.draft_quantize, *(["--threads", str(threads)] if threads else [])],
    )
    started = time.monotonic()
    async with Lab(config, say=console.print) as lab:
        await lab.deploy()
        console.print(f"stack deployed in {time.monotonic() - started:.0f} s: {lab.deployed}")
        async with channel(lab.address) as orchestrator:
            stub = specdecode_pb2_grpc.SpecDecodeStub(orchestrator)
            for mode in MODES:  # warm-up: both paths, the caches, the connections
                await complete(stub, request(prompts[0], 8, args.k, mode))
            info = await stub.Info(common_pb2.InfoRequest())
            runs = await sweep(lab, stub, rtts, prompts, args, console)
    return {
        "lab": "namespaces" if config.namespaces else "loopback",
        "cpus": cpus,  # role -> its host's CPUs; empty: all shared
        "cpu": cpu_tag(),
        "models": {
            role: {"model": part.model, "dtype": part.dtype, "quantization": part.quantization}
            for role, part in (("draft", info.draft), ("target", info.target))
        },
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "prompts": list(prompts),
        "runs_per_cell": args.runs,
        "rtts_ms": rtts,
        "wall_s": round(time.monotonic() - started, 1),
        "runs": runs,
        "summary": summarize(runs, rtts, args.k),
    }


def request(prompt: str, max_new_tokens: int, k: int, mode: str):
    message = make_request(prompt, max_new_tokens, draft_tokens=k, ignore_eos=True, drafter="model")
    message.draft_ahead = mode
    return message


async def sweep(lab: Lab, stub, rtts, prompts, args, console: Console) -> list[dict]:
    runs = []
    for rtt in rtts:
        lab.set_rtt(rtt)
        for prompt_index, prompt in enumerate(prompts):
            for attempt in range(args.runs):
                order = MODES if attempt % 2 == 0 else MODES[::-1]  # neither mode always runs first
                for mode in order:
                    started = time.perf_counter()
                    done = await complete(stub, request(prompt, args.max_new_tokens, args.k, mode))
                    seconds = time.perf_counter() - started
                    runs.append(describe(rtt, prompt_index, mode, seconds, done))
                    console.print(
                        f"RTT {rtt:g} ms, prompt {prompt_index}, run {attempt}, draft-ahead {mode}: "
                        f"{runs[-1]['tokens_per_s']:.2f} tokens/s"
                    )
            cell = [run for run in runs if run["rtt_ms"] == rtt and run["prompt"] == prompt_index]
            outputs = {tuple(run.pop("token_ids")) for run in cell}
            cell[-1]["outputs_agree"] = len(outputs) == 1  # every run of both modes gave the same tokens
    return runs


def describe(rtt: float, prompt: int, mode: str, seconds: float, done) -> dict:
    stats = done.final.stats
    drafting = [index for index, k in enumerate(stats.draft_lengths) if k]
    return {
        "rtt_ms": rtt,
        "prompt": prompt,
        "draft_ahead": mode,
        "seconds": round(seconds, 3),
        "tokens": len(done.token_ids),
        "token_ids": list(done.token_ids),
        "tokens_per_s": round(len(done.token_ids) / seconds, 3),
        "acceptance_rate": round(stats.acceptance_rate, 3),
        "steps": stats.steps,
        "drafting_steps": len(drafting),
        "drafted": stats.drafted,
        "all_accepted_steps": stats.accepted_per_position[-1] if stats.accepted_per_position else 0,
        # inside the services, per drafting step: the draft's Propose (0 when drafted ahead) and the verify
        "draft_served_s": sum(stats.step_draft_seconds[i] for i in drafting),
        "verify_served_s": sum(stats.step_verify_seconds[i] for i in drafting),
        "network_s": round(stats.network_seconds, 4),
        "other_s": round(stats.other_seconds, 4),
        "ahead_steps": stats.ahead_steps,
        "ahead_ready": stats.ahead_ready,
        "ahead_late": stats.ahead_late,
        "ahead_wasted_tokens": stats.ahead_wasted_tokens,
        "ahead_hidden_s": round(stats.ahead_hidden_seconds, 4),
    }


def summarize(runs: list[dict], rtts: list[float], k: int) -> list[dict]:
    """Per RTT: measured tokens/s of each mode (summed over prompts and runs), and the expectation
    from the synchronous runs' own costs (draft_ahead_gain, separate cores: shared = 0)."""
    rows = []
    for rtt in rtts:
        sync = [run for run in runs if run["rtt_ms"] == rtt and run["draft_ahead"] == "off"]
        ahead = [run for run in runs if run["rtt_ms"] == rtt and run["draft_ahead"] == "on"]
        measured = {
            mode: sum(r["tokens"] for r in of) / sum(r["seconds"] for r in of)
            for mode, of in (("off", sync), ("on", ahead))
        }
        t_draft = sum(r["draft_served_s"] for r in sync) / max(1, sum(r["drafted"] for r in sync))
        t_verify = sum(r["verify_served_s"] for r in sync) / max(1, sum(r["drafting_steps"] for r in sync))
        calls = sum(r["steps"] + r["drafting_steps"] for r in sync)  # a drafting step makes two calls
        rtt_call = sum(r["network_s"] for r in sync) / max(1, calls)
        other = sum(r["other_s"] for r in sync) / max(1, sum(r["steps"] for r in sync))
        alpha = statistics.fmean(r["acceptance_rate"] for r in sync)
        all_accepted = sum(min(r["all_accepted_steps"], r["ahead_steps"]) for r in ahead)  # those that drafted ahead
        beta = min(1.0, sum(r["ahead_ready"] for r in ahead) / all_accepted) if all_accepted else alpha
        step = k * t_draft + t_verify + 2 * rtt_call + other
        gain = draft_ahead_gain(alpha, beta, k, k, t_draft, t_verify, rtt_call, rtt_call)
        tokens = expected_tokens(alpha, k)
        rows.append(
            {
                "rtt_ms": rtt,
                "sync_tokens_per_s": round(measured["off"], 3),
                "ahead_tokens_per_s": round(measured["on"], 3),
                "speedup": round(measured["on"] / measured["off"], 3),
                "expected_sync_tokens_per_s": round(tokens / step, 3),
                "expected_ahead_tokens_per_s": round(tokens / (step - gain), 3),
                "expected_speedup": round(step / (step - gain), 3),
                "measured": {
                    "alpha": round(alpha, 3),
                    "bonus_match": round(beta, 3),
                    "t_draft_s": round(t_draft, 4),
                    "t_verify_s": round(t_verify, 4),
                    "rtt_per_call_s": round(rtt_call, 4),
                    "other_per_step_s": round(other, 4),
                },
                "ahead_ready_share": round(
                    sum(r["ahead_ready"] for r in ahead) / max(1, sum(r["drafting_steps"] for r in ahead)), 3
                ),
            }
        )
    return rows


def print_summary(report: dict, console: Console) -> None:
    cpus = report["cpus"] or "shared"
    table = Table(title=f"tokens/s, K={report['k']}, synchronous vs draft-ahead ({report['lab']} lab, cpus {cpus})")
    for header in ("RTT ms", "sync", "ahead", "speed-up", "expected sync", "expected ahead", "expected ×", "α", "β"):
        table.add_column(header, justify="right")
    for row in report["summary"]:
        table.add_row(
            f"{row['rtt_ms']:g}",
            f"{row['sync_tokens_per_s']:.2f}",
            f"{row['ahead_tokens_per_s']:.2f}",
            f"{row['speedup']:.2f}×",
            f"{row['expected_sync_tokens_per_s']:.2f}",
            f"{row['expected_ahead_tokens_per_s']:.2f}",
            f"{row['expected_speedup']:.2f}×",
            f"{row['measured']['alpha']:.2f}",
            f"{row['measured']['bonus_match']:.2f}",
        )
    console.print(table)
    agree = [run["outputs_agree"] for run in report["runs"] if "outputs_agree" in run]
    console.print(f"outputs identical across modes and runs for {sum(agree)} of {len(agree)} (RTT, prompt) cells")


def save_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    summary = report["summary"]
    rtts = [row["rtt_ms"] for row in summary]
    for key, label, color in (("sync", "synchronous", "tab:blue"), ("ahead", "draft-ahead", "tab:orange")):
        axes.plot(rtts, [row[f"{key}_tokens_per_s"] for row in summary], marker="o", color=color, label=label)
        expected = [row[f"expected_{key}_tokens_per_s"] for row in summary]
        axes.plot(rtts, expected, linestyle="--", color=color, label=f"{label}, expected")
    for row in summary:
        axes.annotate(
            f"{row['speedup']:.2f}×",
            (row["rtt_ms"], row["ahead_tokens_per_s"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
        )
    axes.set(xlabel="round-trip time, ms", ylabel="tokens/s", ylim=(0, None))
    axes.legend()
    figure.suptitle(
        f"draft-ahead in the network lab ({report['lab']}, K={report['k']}, {len(report['prompts'])} prompts x "
        f"{report['runs_per_cell']} runs x {report['max_new_tokens']} tokens)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def tiny_models() -> dict[str, str]:
    """Tiny random models of the real architecture, with the default pair's tokenizer (a smoke run)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from specd.model.fetch import resolve_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="specd-tiny-"))
    tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer("draft"))
    config = dict(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    torch.manual_seed(2)
    model = Qwen2ForCausalLM(Qwen2Config(**config, num_attention_heads=4, num_key_value_heads=2))
    for role in ("draft", "target"):  # one model twice: the draft accepts everything, and β is 1
        model.save_pretrained(folder / role)
        tokenizer.save_pretrained(folder / role)
    return {role: str(folder / role) for role in ("draft", "target")}


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
