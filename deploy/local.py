"""The whole stack on this machine: draft, target and orchestrator, each its own process.

Each child is `python -m specd serve ...`; the stack waits on grpc.health.v1 until each one
reports SERVING, and stops them all (SIGTERM, then SIGKILL) however it ends. A stack whose drafter
only looks up (`ngram`, `suffix`: lookup.py LOOKUP_ONLY) runs no draft service, only the target and
the orchestrator. `share_cores` is how `specd up` gives the two model services this machine's cores
without oversubscribing them.
"""

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from specd.deploy.roles import RoleConfig
from specd.orchestrator.lookup import LOOKUP_ONLY
from specd.orchestrator.remote import wait_until_serving
from specd.proto.host import DEFAULT_DRAIN_SECONDS

REPLICA_PORT_STEP = 100  # replica i of a role listens on the role's ports + 100 i (50062, 50162, ...)


@dataclass
class StackConfig:
    dtype: str | None = None
    threads: int | None = None  # torch threads of each model service; None: the service's default (all cores)
    # Each role's model, engine settings (None: the service's default), threads (over `threads`), ports
    # (0: free ones; replica i on the first's + REPLICA_PORT_STEP i) and replicas (deploy/roles.py): one
    # orchestrator routes requests over the replicas of each role (router.py)
    draft: RoleConfig = field(default_factory=lambda: RoleConfig("draft"))
    target: RoleConfig = field(default_factory=lambda: RoleConfig("target"))
    port: int = 0  # the orchestrator's
    http_port: int = 0  # the orchestrator's OpenAI-compatible API
    metrics_port: int = 0  # its Prometheus /metrics
    ray_address: str | None = None
    workers: int = 2
    draft_tokens: int | None = None  # the orchestrator's default K; None: adaptive
    drafter: str | None = None  # the orchestrator's default drafter; None: its own (hybrid); ngram/suffix: no draft
    draft_ahead: str | None = None  # the orchestrator's --draft-ahead; None: its own (auto)
    routing: str | None = None  # the orchestrator's --routing over the replicas; None: its own (prefix)
    migration_limit: int | None = None  # its --migration-limit; None: its own
    step_deadline: float | None = None  # its --step-deadline (a silent target replica's); None: its own
    otlp_endpoint: str | None = None  # OpenTelemetry collector of all three processes (--otlp-endpoint); None: off
    drain_seconds: float | None = None  # --drain-seconds of all three processes; None: their default (30)
    prefix_cache_tokens: int | None = None  # both model services' --prefix-cache-tokens; None: their default (auto)
    exactness: str | None = None  # both model services' --exactness; None: their default (bitwise)
    extra_service_flags: list[str] = field(default_factory=list)
    # Environment of the two model services, where this process's own does not set the variable
    # (`specd up` puts SHARED_CORES_ENV here).
    service_env: dict[str, str] = field(default_factory=dict)

    @property
    def with_draft(self) -> bool:
        """Whether the stack runs a draft service: not for a drafter that never asks it (ngram, suffix)."""
        return self.drafter not in LOOKUP_ONLY


@dataclass
class Child:
    name: str
    address: str
    process: subprocess.Popen
    log: Path
    metrics_url: str = ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class LocalStack:
    def __init__(self, config: StackConfig, say=lambda message: print(message, file=sys.stderr, flush=True)):
        self.config = config
        self.say = say
        self.children: list[Child] = []
        self.log_dir = Path(tempfile.mkdtemp(prefix="specd-up-"))
        self.http_port = config.http_port or free_port()

    @property
    def address(self) -> str:
        return self.children[-1].address

    @property
    def http_url(self) -> str:
        """Base URL of the orchestrator's OpenAI-compatible API."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    async def start(self) -> "LocalStack":
        config = self.config
        drafts = [self._service("draft", i) for i in range(config.draft.replicas if config.with_draft else 0)]
        targets = [self._service("target", i) for i in range(config.target.replicas)]
        loading = f"the draft ({config.draft.model}) and the target ({config.target.model})"
        if not drafts:
            loading = f"the target ({config.target.model}), no draft: the {config.drafter} drafter only looks up"
        for role, pool in (("draft", drafts), ("target", targets)):
            loading += f"; {len(pool)} {role} replicas" if len(pool) > 1 else ""
        self.say(f"loading {loading}; logs in {self.log_dir}")
        started = time.monotonic()
        await asyncio.gather(*(self._wait(child) for child in (*drafts, *targets)))
        self.say(f"models ready in {time.monotonic() - started:.0f} s; starting the orchestrator on Ray")
        orchestrator = self._spawn(
            "orchestrator",
            config.port,
            config.metrics_port,
            [
                "orchestrator",
                *(["--draft", ",".join(draft.address for draft in drafts)] if drafts else []),
                "--target",
                ",".join(target.address for target in targets),
                "--http-port",
                str(self.http_port),
                "--workers",
                str(config.workers),
                *_flags(
                    ray_address=config.ray_address,
                    draft_tokens=config.draft_tokens,
                    drafter=config.drafter,
                    draft_ahead=config.draft_ahead,
                    routing=config.routing,
                    migration_limit=config.migration_limit,
                    step_deadline=config.step_deadline,
                    otlp_endpoint=config.otlp_endpoint,
                    drain_seconds=config.drain_seconds,
                ),
            ],
        )
        await self._wait(orchestrator)
        return self

    def _service(self, role: str, replica: int = 0) -> Child:
        """`specd serve draft|target` with this stack's flags for that role (its RoleConfig); `replica` > 0:
        another replica of that role, on the first's ports + REPLICA_PORT_STEP × replica (free ones where
        those are 0)."""
        config = self.config
        own = getattr(config, role)
        flags = _flags(
            threads=own.threads or config.threads,
            quantize=own.quantize,
            device=own.device,
            cuda_graphs=own.cuda_graphs,
            engine=own.engine,
            otlp_endpoint=config.otlp_endpoint,
            drain_seconds=config.drain_seconds,
            prefix_cache_tokens=config.prefix_cache_tokens,
            exactness=config.exactness,
        )
        serve_args = [role, "--model", own.model, *_flags(dtype=config.dtype), *flags, *config.extra_service_flags]
        ports = [port + REPLICA_PORT_STEP * replica if port else 0 for port in (own.port, own.metrics_port)]
        name = f"{role}-{replica}" if replica else role
        return self._spawn(name, *ports, serve_args, config.service_env)

    def _spawn(
        self, name: str, port: int, metrics_port: int, serve_args: list[str], env: dict[str, str] | None = None
    ) -> Child:
        port, metrics_port = port or free_port(), metrics_port or free_port()
        log = self.log_dir / f"{name}.log"
        command = [
            sys.executable,
            "-m",
            "specd.cli",
            "serve",
            *serve_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
        ]
        process = subprocess.Popen(
            command,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**env, **os.environ} if env else None,  # what the caller's environment sets wins
        )
        child = Child(name, f"127.0.0.1:{port}", process, log, f"http://127.0.0.1:{metrics_port}/metrics")
        self.children.append(child)
        return child

    async def _wait(self, child: Child) -> None:
        waiting = asyncio.create_task(wait_until_serving(child.address, timeout_s=900))
        while not waiting.done():
            if child.process.poll() is not None:
                waiting.cancel()
                raise RuntimeError(
                    f"the {child.name} service exited with code {child.process.returncode}:\n{child.tail()}"
                )
            await asyncio.sleep(0.25)
        await waiting

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM to all three: each drains (the requests in flight get --drain-seconds to finish)
        and exits; SIGKILL for any still running after `timeout_s` (default: the drain + 10 s). A
        Ctrl-C while they drain passes a second SIGTERM on, which cuts their drains short."""
        if timeout_s is None:
            timeout_s = (DEFAULT_DRAIN_SECONDS if self.config.drain_seconds is None else self.config.drain_seconds) + 10
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            while True:
                try:
                    child.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(child.process.pid, signal.SIGKILL)
                    child.process.wait()
                except KeyboardInterrupt:
                    self._signal(signal.SIGTERM)
                    continue
                break
        self.children.clear()

    def _signal(self, signum: int) -> None:
        for child in reversed(self.children):
            if child.process.poll() is None:
                os.killpg(child.process.pid, signum)


# ---------------------------------------------------------------- sharing the cores of one machine

# Set in both model services by `specd up` (issue 21, docs/deploying/one-machine.md): an OpenMP thread that has
# done its part of an operation sleeps instead of spinning (libgomp, torch's OpenMP on Linux, spins
# for ~300,000 iterations by default), so a service that waits for its next call leaves the cores
# to the one that computes instead of burning them. Not for ggml's threads, which meet at a barrier
# after every op: a service on the llama.cpp engine drops it (cli/serve.py: let_ggml_threads_spin).
SHARED_CORES_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def usable_cores() -> int:
    """The cores this process may run on: its affinity (a container's cpuset, `taskset`), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity on this platform
        return os.cpu_count() or 1


def share_cores(cores: int, on_cpu: Iterable[str] = ("draft", "target")) -> dict[str, int]:
    """Torch threads for each model service in `on_cpu` (those that compute on the CPU) sharing `cores`.

    The rule (measured on 2 cores: docs/performance/under-load.md): the target takes every core, since it runs
    on every step and with one stream the two services take turns (the target alone is 1.5x faster
    on 2 threads than on 1); the draft, smaller, takes a quarter of them, at least one, so that
    where several streams make its passes overlap the target's the two add up to the cores plus
    a quarter (at least one) instead of twice the cores; with SHARED_CORES_ENV the threads of a
    service that waits sleep. A service alone on the CPU, the other on a GPU, takes every core.
    """
    cores = max(1, cores)
    threads = dict.fromkeys(on_cpu, cores)
    if {"draft", "target"} <= threads.keys():
        threads["draft"] = max(1, cores // 4)
    return threads


# Ports a stack picks ahead of binding them come from here: below Linux's ephemeral range (32768 on,
# where every outgoing connection and every port-0 bind takes its local port) and above Ray's
# worker ports (10002-19999), so that between the pick and the bind no other process takes it
# (the network lab's actors failed with EADDRINUSE on ports picked with port 0).
PICKED_PORTS = range(20_000, 32_768)


def free_port() -> int:
    """A port free now on every interface, from PICKED_PORTS (the OS's own pick if none is found)."""
    for _ in range(200):
        port = random.choice(PICKED_PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _flags(**values) -> list[str]:
    """--name value for each value that is set."""
    return [
        item
        for name, value in values.items()
        if value is not None
        for item in (f"--{name.replace('_', '-')}", str(value))
    ]
