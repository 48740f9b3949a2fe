"""Total output tokens/s at 1, 2, 4, 8 concurrent streams: speculative and speculation-off,
with and without batching in the services, measured side by side in one run.

    .venv/bin/python scripts/bench_batching.py [--streams 1,2,4,8] [--max-new-tokens 32]
        [--dtype bfloat16] [--json docs/results/batching.json] [--plot docs/results/batching.png]

For each setting (batching off = `--max-batch-size 1`, then on = the default) it starts the
real stack (`specd.deploy.local`), runs the load-test harness's closed loop at each stream
count (as many requests as streams, so every stream runs one request at once), with K = the
server default and with speculation off, and reads the batch sizes the services ran from Info.
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

import grpc

from specd.bench.loadtest import Settings, load_prompts, run_loadtest
from specd.deploy.local import LocalStack, StackConfig
from specd.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

SETTINGS = {"batching off": ["--max-batch-size", "1"], "batching on": []}


async def measure(args) -> dict:
    streams = [int(count) for count in args.streams.split(",")]
    prompts = load_prompts()
    results = {}
    for name, flags in SETTINGS.items():
        stack = await LocalStack(StackConfig(dtype=args.dtype, extra_service_flags=flags)).start()
        try:
            for mode, k in (("speculative", None), ("speculation off", 0)):
                for count in streams:
                    before = await batch_sizes(stack)
                    settings = Settings(stack.address, prompts, args.max_new_tokens, draft_tokens=k)
                    report = await run_loadtest(settings, requests=count, concurrency=[count])
                    run = report["runs"][0]
                    run["batch_sizes"] = difference(await batch_sizes(stack), before)
                    results[f"{name}, {mode}, {count}"] = run
                    print(
                        f"{name:13} {mode:16} {count} streams: {run['output_tokens_per_s']:.2f} tok/s "
                        f"(passes by size: {run['batch_sizes']})",
                        flush=True,
                    )
        finally:
            stack.stop()
    return {"streams": streams, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "runs": results}


async def batch_sizes(stack: LocalStack) -> dict[str, dict[int, int]]:
    """Passes run so far by each service, by batch size."""
    sizes = {}
    stub_classes = (draft_pb2_grpc.DraftServiceStub, target_pb2_grpc.TargetServiceStub)
    for child, stub_class in zip(stack.children[:2], stub_classes):
        async with grpc.aio.insecure_channel(child.address) as channel:
            info = await stub_class(channel).Info(common_pb2.InfoRequest())
        sizes[child.name] = dict(info.batch_sizes)
    return sizes


def difference(after: dict, before: dict) -> dict:
    return {
        name: {
            size: count - before[name].get(size, 0)
            for size, count in sorted(passes.items())
            if count - before[name].get(size, 0)
        }
        for name, passes in after.items()
    }


def table(report: dict) -> str:
    runs, streams = report["runs"], report["streams"]
    modes = ("speculative", "speculation off")
    lines = ["| streams | " + " | ".join(f"{n}, {m}" for n in SETTINGS for m in modes) + " |", "|---|" + "---|" * 4]
    for count in streams:
        cells = [f"{runs[f'{n}, {m}, {count}']['output_tokens_per_s']:.2f}" for n in SETTINGS for m in modes]
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    base = runs[f"batching off, speculation off, {streams[0]}"]["output_tokens_per_s"]
    best = runs[f"batching on, speculative, {streams[-1]}"]["output_tokens_per_s"]
    lines.append(
        f"\n{streams[-1]}-stream speculative with batching / single-stream speculation-off: "
        f"{best / base:.2f}x (goal 3x)"
    )
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams, runs = report["streams"], report["runs"]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in SETTINGS:
        for mode, style in (("speculative", "-o"), ("speculation off", "--s")):
            values = [runs[f"{name}, {mode}, {count}"]["output_tokens_per_s"] for count in streams]
            axes.plot(streams, values, style, label=f"{name}, {mode}")
    base = runs[f"batching off, speculation off, {streams[0]}"]["output_tokens_per_s"]
    axes.axhline(3 * base, color="grey", linewidth=0.8, linestyle=":", label="goal: 3x single-stream speculation-off")
    axes.set(
        xlabel="concurrent streams",
        ylabel="total output tokens/s",
        xticks=streams,
        title=f"Batching across requests ({report['dtype'] or 'default dtype'}, "
        f"{report['max_new_tokens']} tokens each)",
    )
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: the services' default)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    report = asyncio.run(measure(args))
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
