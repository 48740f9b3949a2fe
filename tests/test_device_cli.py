"""The device flags around the engine (issue 15): `--device`, `--draft-device` and `--cuda-graphs` on
`specd serve`, `up`, `generate` and `bench` reach load_engine (as real processes and Ray actors do it),
as do the engine flags (`--engine`, and `--draft-engine` on a stack),
a device that does not exist here is one line on stderr and exit status 2 before anything starts,
and a service's Info says where it computes (device, its name, total and free memory)."""

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from specd.cli import build_parser
from specd.cli.common import UserError, check_stack_devices
from specd.deploy import cluster
from specd.deploy.cluster import ModelServiceActor, placement
from specd.deploy.local import Child, LocalStack, StackConfig, free_port
from specd.deploy.roles import RoleConfig
from specd.orchestrator.remote import wait_until_serving
from specd.proto.limits import Limits
from specd.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here: --device cuda exists")
CPU_KV_BUDGET = 262_144  # --max-cached-tokens 0 (auto) on a CPU (model/service.py)


def specd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd.cli", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_exit_2(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # nothing started: no "loading ..." line, no server output
    assert lines[0].startswith("specd: error: ")
    for word in words:
        assert word in lines[0], lines[0]
    assert result.stdout == ""
    return lines[0]


# ---------------------------------------------------------------- a device that is not here: one line, exit 2

EVERY_COMMAND = {
    "serve target": ["serve", "target"],
    "serve draft": ["serve", "draft"],
    "up": ["up"],
    "generate": ["generate", "def f():"],
    "bench": ["bench", "--quick"],
}


@NO_GPU
@pytest.mark.parametrize("command", EVERY_COMMAND)
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(command):
    line = assert_one_line_exit_2(specd(*EVERY_COMMAND[command], "--device", "cuda"), "--device cuda", "no CUDA GPU")
    assert "use --device cpu or auto" in line


@NO_GPU
@pytest.mark.parametrize("command", ["up", "generate", "bench"])
def test_draft_device_cuda_without_a_gpu_names_its_own_flag(command):
    line = assert_one_line_exit_2(specd(*EVERY_COMMAND[command], "--draft-device", "cuda:1"), "--draft-device cuda:1")
    assert "--device" not in line.replace("--draft-device", "")


@pytest.mark.parametrize("command", EVERY_COMMAND)
def test_an_unknown_device_is_one_line_and_exit_2(command):
    assert_one_line_exit_2(specd(*EVERY_COMMAND[command], "--device", "bogus"), "--device bogus", "cuda:N")


def test_an_unknown_device_for_a_cluster_is_refused_before_ray_is_reached():
    # 127.0.0.1:1 answers nothing: the device's form is checked first, without torch or Ray
    assert_one_line_exit_2(specd("up", "--ray-address", "127.0.0.1:1", "--draft-device", "tpu"), "--draft-device tpu")


def test_cuda_graphs_on_a_cpu_device_is_one_line_and_exit_2():
    assert_one_line_exit_2(specd("serve", "target", "--device", "cpu", "--cuda-graphs", "on"), "--cuda-graphs on")
    assert_one_line_exit_2(specd("up", "--device", "cpu", "--cuda-graphs", "on"), "--cuda-graphs on")


# ---------------------------------------------------------------- the flags as the stack passes them on


def stack_args(*argv: str):
    return build_parser().parse_args(["up", *argv])


def test_cuda_graphs_on_goes_to_the_services_on_a_gpu_only():
    # On a cluster the devices resolve on the nodes: only the form is checked here (no torch needed)
    assert check_stack_devices(stack_args(), here=False) == {"draft": "auto", "target": "auto"}
    assert check_stack_devices(stack_args("--cuda-graphs", "off"), here=False) == {"draft": "off", "target": "off"}
    # the draft's auto is the CPU: it runs eager; the target's auto may be a GPU there
    assert check_stack_devices(stack_args("--cuda-graphs", "on"), here=False) == {"draft": "off", "target": "on"}
    both = stack_args("--cuda-graphs", "on", "--draft-device", "cuda:1")
    assert check_stack_devices(both, here=False) == {"draft": "on", "target": "on"}
    with pytest.raises(UserError, match="--cuda-graphs on needs a CUDA device"):
        check_stack_devices(stack_args("--cuda-graphs", "on", "--device", "cpu"), here=False)
    with pytest.raises(UserError, match="--device CUDA:x: unknown device"):
        check_stack_devices(stack_args("--device", "CUDA:x"), here=False)
    assert check_stack_devices(stack_args("--device", " CUDA:0 "), here=False) == {"draft": "auto", "target": "auto"}


def test_a_target_actor_asks_ray_for_the_gpus_it_is_given():
    assert placement("target", {"CPU": 8, "GPU": 2, "target": 1}, gpus=1) == {
        "resources": {"target": 0.01},
        "num_cpus": 0,
        "num_gpus": 1,
    }
    assert placement("target", {"CPU": 8, "GPU": 2}, gpus=2) == {"num_gpus": 2, "num_cpus": 0}  # placed by GPU
    assert placement("target", {"CPU": 8, "GPU": 2}) == {"num_gpus": 1, "num_cpus": 0}
    assert placement("target", {"CPU": 8, "target": 1}) == {"resources": {"target": 0.01}, "num_cpus": 0}
    args = build_parser().parse_args(["up", "--ray-address", "auto", "--target-gpus", "1"])
    assert args.target_gpus == 1 and build_parser().parse_args(["up"]).target_gpus == 0


# ---------------------------------------------------------------- the engine flags as the stack passes them on

ENGINE_FLAGS = ("--device", "cpu", "--draft-device", "cpu", "--engine", "transformers", "--draft-engine", "llama.cpp")


class Spawned(Exception):
    """What a fake raises once the stack has said what it would start, so that nothing starts."""


def serve_commands(monkeypatch) -> dict[str, list[str]]:
    """The `specd serve` arguments of each child a LocalStack starts (by name), none of them started."""
    spawned: dict[str, list[str]] = {}

    def spawn(self, name, port, metrics_port, serve_args, env=None):
        spawned[name] = serve_args
        return Child(name, "127.0.0.1:1", process=None, log=Path(""))

    async def wait(self, child):
        raise Spawned(child.name)

    monkeypatch.setattr(LocalStack, "_spawn", spawn)
    monkeypatch.setattr(LocalStack, "_wait", wait)
    return spawned


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def start_here(command: str, *flags: str) -> None:
    """`specd up` or `specd generate` (embedded stack) on this machine, up to the first wait."""
    from specd.cli import generate, up

    if command == "up":
        args = stack_args(*flags)
        up.run_here(args, check_stack_devices(args))  # not up.run: it sets this process's SIGTERM handler
    else:
        generate.run(build_parser().parse_args(["generate", "def f():", "--no-baseline", *flags]))


@pytest.mark.parametrize("command", ["up", "generate"])
def test_the_engine_flags_reach_each_service_command_line(monkeypatch, command):
    spawned = serve_commands(monkeypatch)
    with pytest.raises(Spawned):
        start_here(command, *ENGINE_FLAGS)
    assert flag_value(spawned["draft"], "--engine") == "llama.cpp"
    assert flag_value(spawned["target"], "--engine") == "transformers"
    assert flag_value(spawned["draft"], "--cuda-graphs") == "auto"  # beside the other flags each child gets
    with pytest.raises(Spawned):
        start_here(command, "--device", "cpu", "--draft-device", "cpu")
    assert {flag_value(spawned[role], "--engine") for role in ("draft", "target")} == {"auto"}


def test_a_stack_without_an_engine_leaves_each_service_its_default(monkeypatch):
    spawned = serve_commands(monkeypatch)
    with pytest.raises(Spawned):
        asyncio.run(LocalStack(StackConfig()).start())
    assert "--engine" not in spawned["draft"] + spawned["target"]


def test_up_on_a_cluster_hands_each_service_actor_its_engine(monkeypatch):
    """`specd up --ray-address`: ClusterConfig to ModelServiceActor's arguments, Ray faked (no cluster)."""
    from specd.cli.up import run_on_cluster

    started: dict[str, tuple] = {}

    class Actor:
        @staticmethod
        def options(**options):
            return Actor

        @staticmethod
        def remote(role, *arguments, **keywords):
            started[role] = arguments
            assert keywords == {"exactness": "bitwise"}  # --exactness's default, to both services
            raise Spawned(role)

    monkeypatch.setattr(cluster, "ModelServiceActor", Actor)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [{}])
    monkeypatch.setattr(cluster.ClusterStack, "stop", lambda self: None)
    args = stack_args("--ray-address", "auto", *ENGINE_FLAGS)
    with pytest.raises(Spawned):
        run_on_cluster(args, check_stack_devices(args, here=False))
    # the actor's role settings (its first argument after the role): device, cuda_graphs, engine
    for role, engine in (("draft", "llama.cpp"), ("target", "transformers")):
        settings = started[role][0]
        assert (settings.device, settings.cuda_graphs, settings.engine) == ("cpu", "auto", engine)


def test_a_cluster_pool_gives_each_replica_an_actor_and_ports_of_its_own(monkeypatch):
    """`specd up --ray-address auto --target-replicas 3 --draft-replicas 2`: an actor per replica, named
    and on ports apart (replica i: the role's ports + 100 i), and every orchestrator replica dials the
    whole pools (Ray faked: each actor answers `where` at once)."""
    from specd.cli.up import run_on_cluster

    spawned, dialled = [], []

    class Actor:
        name = ""

        @classmethod
        def options(cls, name, **options):
            cls.name = name
            return cls

        @classmethod
        def remote(cls, role, settings, dtype, limits, port, metrics_port, *rest, **keywords):
            spawned.append((cls.name, port, metrics_port))
            return cls

    async def locate(self, deployed):
        deployed.address = f"node:{spawned[-1][1]}"
        self.deployed.append(deployed)
        return deployed

    async def serving(self, deployed, timeout_s):
        return None

    async def orchestrator(self, index, draft_address, target_address, resources):
        dialled.append((draft_address, target_address))
        raise Spawned("orchestrator")

    monkeypatch.setattr(cluster, "ModelServiceActor", Actor)
    monkeypatch.setattr(cluster.ClusterStack, "_locate", locate)
    monkeypatch.setattr(cluster.ClusterStack, "_until_serving", serving)
    monkeypatch.setattr(cluster.ClusterStack, "_start_orchestrator", orchestrator)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [{}])
    monkeypatch.setattr(cluster.ClusterStack, "stop", lambda self: None)
    args = stack_args("--ray-address", "auto", "--target-replicas", "3", "--draft-replicas", "2")
    with pytest.raises(Spawned):
        run_on_cluster(args, check_stack_devices(args, here=False))
    assert sorted(spawned) == [
        ("specd-draft", 50061, 9461),
        ("specd-draft-1", 50161, 9561),
        ("specd-target", 50062, 9462),
        ("specd-target-1", 50162, 9562),
        ("specd-target-2", 50262, 9662),
    ]
    assert dialled == [("node:50061,node:50161", "node:50062,node:50162,node:50262")]


# ---------------------------------------------------------------- real processes: Info says where each computes


async def info_of(role: str, address: str) -> common_pb2.ModelInfo:
    stub = draft_pb2_grpc.DraftServiceStub if role == "draft" else target_pb2_grpc.TargetServiceStub
    async with grpc.aio.insecure_channel(address) as channel:
        return await stub(channel).Info(common_pb2.InfoRequest(), timeout=10)


def assert_on_the_cpu(info: common_pb2.ModelInfo) -> None:
    assert info.device == "cpu"
    assert info.device_name.strip()
    assert info.device_memory_total_bytes > 0
    assert 0 < info.device_memory_free_bytes <= info.device_memory_total_bytes


@pytest.mark.parametrize("role, flags", [("target", []), ("draft", ["--cuda-graphs", "off", "--quantize", "none"])])
async def test_specd_serve_on_the_cpu_reports_its_device_in_info(tiny_dirs, tmp_path, role, flags):
    port = free_port()
    log = tmp_path / f"{role}.log"
    command = [sys.executable, "-m", "specd.cli", "serve", role, "--model", str(tiny_dirs[role]), "--dtype", "float32"]
    command += ["--threads", "1", "--device", "cpu", *flags, "--port", str(port), "--no-metrics"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        await wait_until_serving(f"127.0.0.1:{port}", timeout_s=120)
        first = await info_of(role, f"127.0.0.1:{port}")
        assert_on_the_cpu(first)
        assert first.role == role and first.dtype == "float32"
        assert first.max_cached_tokens == CPU_KV_BUDGET  # --max-cached-tokens defaults to 0: auto, on a CPU this
        second = await info_of(role, f"127.0.0.1:{port}")  # read again at each call: the same device
        assert (second.device, second.device_memory_total_bytes) == (first.device, first.device_memory_total_bytes)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert process.returncode == 0, log.read_text()[-3000:]


def command_line(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # ended meanwhile
        return []


# ---------------------------------------------------------------- the cluster's actors hand the flags to load_engine


async def actor_failure(actor, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    await actor.where.remote()
    while time.monotonic() < deadline:
        if why := await actor.failure.remote():
            return why
        await asyncio.sleep(0.25)
    raise AssertionError("the service loaded: its device was not checked")


async def test_a_service_actor_hands_device_cuda_graphs_and_engine_to_load_engine(tiny_dirs, ray_local):
    """No command line in between (it would refuse the first two first): load_engine itself refuses them."""
    model = str(tiny_dirs["target"])
    cases = {
        "on a CPU": ("cpu", "on", "auto", "DeviceUnavailable", "--cuda-graphs on needs a CUDA device"),
        "no GGUF": ("cpu", "off", "llama.cpp", "ValueError", "--engine llama.cpp needs a GGUF"),
    }
    if not torch.cuda.is_available():
        cases["no GPU"] = ("cuda", "auto", "auto", "DeviceUnavailable", "no CUDA GPU is visible")
    actors = {
        name: ModelServiceActor.options(num_cpus=0).remote(
            "target", RoleConfig(model, "auto", device, graphs, engine, 1), "float32", Limits(), free_port(), None
        )
        for name, (device, graphs, engine, _, _) in cases.items()
    }
    try:
        failures = await asyncio.gather(*(actor_failure(actor) for actor in actors.values()))
        for (name, (*_, error, expected)), why in zip(cases.items(), failures):
            assert error in why and expected in why, (name, why)
    finally:
        for actor in actors.values():
            ray_local.kill(actor)
