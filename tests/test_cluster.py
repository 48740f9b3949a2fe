"""specd deployed onto a real Ray cluster (`ray start`, `specd up --ray-address`): every server in a
Ray actor; Ray restarts an actor that dies, the deployer restarts one that stops answering health checks.
Tiny random models (float32) on a one-node cluster offering the draft, target and orchestrator resources.
"""

import asyncio
import os
import signal
import time

from specd.deploy.cluster import placement
from specd.deploy.lab import Lab, LabConfig, process_alive
from specd.orchestrator.remote import wait_until_serving
from specd.proto.client import channel, complete, make_request
from specd.v1 import specdecode_pb2_grpc

PROMPT = "def quicksort(arr):"


def test_placement_follows_the_cluster_resources():
    assert placement("draft", {"CPU": 8, "draft": 1}) == {"resources": {"draft": 0.01}, "num_cpus": 0}
    assert placement("draft", {"CPU": 8, "GPU": 1}) == {"num_cpus": 0}  # no draft nodes: anywhere
    assert placement("target", {"CPU": 8, "GPU": 2}) == {"num_gpus": 1, "num_cpus": 0}
    assert placement("target", {"CPU": 8, "GPU": 2, "target": 1}) == {"resources": {"target": 0.01}, "num_cpus": 0}
    assert placement("target", {"CPU": 8}) == {"num_cpus": 0}
    assert placement("orchestrator", {"CPU": 8, "orchestrator": 2})["resources"] == {"orchestrator": 0.01}


async def test_ray_restarts_a_dead_or_hung_server_and_output_stays_exact(tiny_dirs):
    config = LabConfig(
        draft_model=str(tiny_dirs["draft"]),
        target_model=str(tiny_dirs["target"]),
        dtype="float32",
        namespaces=False,
        up_flags=["--health-period", "1", "--restart-after", "20"],
    )
    async with Lab(config) as lab:
        await lab.deploy()
        baseline = await generate(lab.address, draft_tokens=0)

        # 1. the draft's process dies: Ray restarts the actor, which binds the same port again
        draft_address, draft_pid = lab.deployed["draft"]
        os.kill(draft_pid, signal.SIGKILL)
        await until_gone_and_serving(draft_pid, draft_address)
        await assert_speculation_exact(lab.address, baseline)

        # 2. the target hangs: its health checks go unanswered, the deployer kills it, Ray restarts it
        target_address, target_pid = lab.deployed["target"]
        os.kill(target_pid, signal.SIGSTOP)
        await until_gone_and_serving(target_pid, target_address)
        await assert_speculation_exact(lab.address, baseline)

        # 3. the orchestrator replica dies: restarted on its port, clients just retry
        orchestrator_address, orchestrator_pid = lab.deployed["orchestrator-0"]
        os.kill(orchestrator_pid, signal.SIGKILL)
        await until_gone_and_serving(orchestrator_pid, orchestrator_address)
        await assert_speculation_exact(lab.address, baseline)


async def generate(address: str, draft_tokens: int):
    async with channel(address) as orchestrator:
        stub = specdecode_pb2_grpc.SpecDecodeStub(orchestrator)
        return await complete(stub, make_request(PROMPT, 16, draft_tokens=draft_tokens, ignore_eos=True), timeout=60)


async def until_gone_and_serving(pid: int, address: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while process_alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still running"
        await asyncio.sleep(0.2)
    await wait_until_serving(address, timeout_s=deadline - time.monotonic())


async def assert_speculation_exact(address: str, baseline) -> None:
    """Greedy output equals speculation off; speculation resumes once the draft back-off has passed."""
    for _ in range(10):
        speculative = await generate(address, draft_tokens=4)
        assert speculative.token_ids == baseline.token_ids
        if speculative.final.stats.drafted > 0:
            return
        await asyncio.sleep(1)
    raise AssertionError("speculation never resumed after the restart")
