"""Tokens/s on one device, side by side in one run: HF `generate` and specd's loop (target only and
speculative), each with eager steps and with CUDA graphs; plus the cost of one decode and one
verify step. What scripts/gpu_check.sh runs on a GPU (issue 15); it runs on a CPU too.

specd's loop here is the orchestrator's Generation over the real draft and target gRPC services
on this machine, without the Ray worker around it (the GPU machine has no Ray). Greedy, every
system gives exactly `--max-new-tokens` tokens per prompt (EOS ignored).

    python scripts/gpu_bench.py --target DIR --draft DIR --device cuda --out docs/results/gpu_bench.json
"""

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from specd.draft_service.drafter import Drafter
from specd.draft_service.server import create_draft_server
from specd.model.devices import device_memory
from specd.model.engine import Row
from specd.model.loading import load_model
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.generation import Generation, GenerationRequest
from specd.proto.limits import Limits
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier
from specd.v1 import draft_pb2_grpc, target_pb2_grpc

PROMPTS = [
    "def quicksort(arr):\n",
    "Explain what a hash map is, in two sentences.",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "Write a SQL query that returns the ten customers with the highest total order value.",
]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(loaded, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """HF `generate`, greedy, target only, on the model's device: tokens/s over all prompts."""
    model, device = loaded.model, loaded.device

    def run(ids: list[int]) -> int:
        input_ids = torch.tensor([ids], device=device)
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
        return out.shape[1] - len(ids)

    run(prompts[0][:8])  # warm-up
    synchronize(device)
    started, tokens = time.perf_counter(), 0
    for ids in prompts:
        tokens += run(ids)
    synchronize(device)
    return {"tokens_per_s": tokens / (time.perf_counter() - started), "tokens": tokens}


class Stack:
    """A draft and a target service on this machine, on real ports, and stubs to them."""

    def __init__(self, draft_loaded, target_loaded, graphs: bool):
        self.servers = [
            create_draft_server(lambda: Drafter(TransformersEngine(draft_loaded, graphs), Limits())),
            create_target_server(lambda: Verifier(TransformersEngine(target_loaded, graphs), Limits())),
        ]

    async def __aenter__(self):
        import grpc

        for server in self.servers:
            await server.start("127.0.0.1:0")
            await server.load()
        self.channels = [grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") for server in self.servers]
        self.draft = draft_pb2_grpc.DraftServiceStub(self.channels[0])
        self.target = target_pb2_grpc.TargetServiceStub(self.channels[1])
        return self

    async def __aexit__(self, *exc):
        for channel in self.channels:
            await channel.close()
        for server in self.servers:
            await server.stop(0)


class _Tokenless:
    def decode(self, ids, skip_special_tokens=True):
        return ""


async def specd_loop(stack: Stack, prompts: list[list[int]], max_new_tokens: int, k: int, streams: int = 1) -> dict:
    """Generation (propose, verify, commit) per prompt, one after another; K fixed (0 = target only).
    With `streams` > 1, that many copies of each prompt run at once (the services batch them)."""

    async def run(ids: list[int], new_tokens: int):
        request = GenerationRequest(list(ids), new_tokens, draft_tokens=k, ignore_eos=True)
        generation = Generation(request, stack.draft, stack.target, _Tokenless(), set())
        tokens, finished = [], None
        async for event in generation.run():
            tokens += getattr(event, "token_ids", [])
            finished = event if hasattr(event, "stats") else finished
        return tokens, finished.stats

    await asyncio.gather(*(run(prompts[0], max_new_tokens) for _ in range(streams)))  # warm-up: captures graphs
    started, outputs, drafted, accepted = time.perf_counter(), [], 0, 0
    for ids in prompts:
        for tokens, stats in await asyncio.gather(*(run(ids, max_new_tokens) for _ in range(streams))):
            outputs.append(tokens)
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    seconds = time.perf_counter() - started
    return {
        "tokens_per_s": sum(map(len, outputs)) / seconds,
        "tokens": sum(map(len, outputs)),
        "k": k,
        "streams": streams,
        "acceptance_rate": accepted / drafted if drafted else None,
        "outputs": outputs,
    }


def step_costs(loaded, graphs: bool, context: int = 200, repeats: int = 30) -> dict:
    """Median ms of a decode step (1 token) and a verify step (5 tokens) at `context` cached tokens."""
    engine = TransformersEngine(loaded, graphs)
    engine.forward([Row("s", list(range(1000, 1000 + context)), 0)])
    costs = {}
    for name, tokens in (("decode_ms", [7]), ("verify_k4_ms", [7, 8, 9, 10, 11])):
        times = []
        for _ in range(repeats + 3):
            synchronize(engine.device)
            started = time.perf_counter()
            engine.forward([Row("s", tokens, len(tokens))])
            synchronize(engine.device)
            times.append((time.perf_counter() - started) * 1000)
            engine.crop("s", context)
        costs[name] = statistics.median(times[3:])
        if engine.slots is not None and engine.slots.graphs:  # the GPU's part: the last graph's replay alone
            graph, _ = engine.slots.graphs[(1, len(tokens), 256)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
            synchronize(engine.device)
            costs[name.replace("_ms", "_replay_ms")] = start.elapsed_time(end) / repeats
    return costs


async def float32_agreement(path: str, device: torch.device, prompts, max_new_tokens: int, k: int) -> dict:
    """In float32 greedy speculation is exact token for token (docs/architecture.md §7): the target
    in float32, eager and with graphs, target only and drafting for itself, against eager target-only."""
    target = load_model(path, "float32", device=device)
    outputs = {}
    for graphs in (False, True):
        async with Stack(target, target, graphs) as stack:
            for name, draft_tokens in (("target_only", 0), ("self_draft", k)):
                result = await specd_loop(stack, prompts[:2], max_new_tokens // 2, draft_tokens)
                outputs[f"{name}_{'graphs' if graphs else 'eager'}"] = result["outputs"]
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {name: tokens == outputs["target_only_eager"] for name, tokens in outputs.items()}


def junit_summary(path: Path) -> dict:
    import xml.etree.ElementTree as ElementTree

    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None]
    return {
        **counts,
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": failed,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tests", type=Path, help="a pytest --junitxml report to record beside the figures")
    args = parser.parse_args()
    device = torch.device(args.device)
    target = load_model(args.target, args.dtype, device=device)
    draft = load_model(args.draft, args.dtype, device=device)
    prompts = [target.tokenizer.encode(prompt) for prompt in PROMPTS]
    graph_modes = [False, True]
    report = {
        "device": str(device),
        "device_name": device_memory(device).name,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "target": args.target,
        "draft": args.draft,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "systems": {},
        "step_costs": {},
    }
    if args.tests and args.tests.exists():
        report["tests"] = junit_summary(args.tests)
        print("tests:", report["tests"], flush=True)
    systems = report["systems"]
    print(f"{report['device_name']}: {len(prompts)} prompts x {args.max_new_tokens} tokens, greedy", flush=True)
    systems["hf_generate"] = hf_generate(target, prompts, args.max_new_tokens)
    print(f"  hf_generate {systems['hf_generate']['tokens_per_s']:.1f} tok/s", flush=True)
    for graphs in graph_modes:
        mode = "graphs" if graphs else "eager"
        report["step_costs"][mode] = step_costs(target, graphs)
        async with Stack(draft, target, graphs) as stack:
            for name, k in (("target_only", 0), ("speculative", args.k)):
                systems[f"specd_{name}_{mode}"] = await specd_loop(stack, prompts, args.max_new_tokens, k)
            systems[f"specd_target_only_8_streams_{mode}"] = await specd_loop(
                stack, prompts[:2], args.max_new_tokens, 0, streams=8
            )
        async with Stack(target, target, graphs) as stack:  # the target drafting for itself: alpha = 1
            systems[f"specd_self_draft_{mode}"] = await specd_loop(stack, prompts, args.max_new_tokens, args.k)
        for name in ("target_only", "speculative", "self_draft", "target_only_8_streams"):
            result = systems[f"specd_{name}_{mode}"]
            print(f"  specd_{name}_{mode} {result['tokens_per_s']:.1f} tok/s alpha={result['acceptance_rate']}")
        print(f"  step costs ({mode}): {report['step_costs'][mode]}", flush=True)
    report["float32_greedy_equal"] = await float32_agreement(args.target, device, prompts, args.max_new_tokens, args.k)
    print("float32, outputs equal to eager target-only:", report["float32_greedy_equal"], flush=True)
    reference = systems["specd_target_only_eager"]["outputs"]
    report["greedy_outputs_equal_target_only"] = {
        name: result["outputs"] == reference for name, result in systems.items() if result.get("streams") == 1
    }
    for result in systems.values():
        result.pop("outputs", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({name: round(r["tokens_per_s"], 1) for name, r in systems.items()}))
    print("greedy outputs equal target-only:", report["greedy_outputs_equal_target_only"])


if __name__ == "__main__":
    asyncio.run(main())
