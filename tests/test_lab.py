"""The network lab: draft, target and orchestrator on three hosts of one real Ray cluster (`ray start`),
the orchestrator reaching both services through delay proxies; greedy output must equal speculation off.

Tiny random models (float32). The namespaced lab needs root; where namespaces are refused it skips
with the reason, and the loopback variant (same proxies, one Ray node) runs in any case.
"""

import subprocess
import time

import pytest

from specd.deploy.lab import Lab, LabConfig, namespaces_refused, process_alive
from specd.proto.client import channel, complete, make_request
from specd.v1 import specdecode_pb2_grpc

RTT_MS = 20
PROMPTS = ("def fibonacci(n):", "The capital of France is")
NEW_TOKENS = 16


async def check_lab(lab: Lab, draft_host_ip: str, target_host_ip: str) -> None:
    assert lab.deployed["draft"][0].startswith(f"{draft_host_ip}:")  # placed by its Ray resource
    assert lab.deployed["target"][0].startswith(f"{target_host_ip}:")
    async with channel(lab.address) as orchestrator:
        stub = specdecode_pb2_grpc.SpecDecodeStub(orchestrator)
        for prompt in PROMPTS:
            started = time.perf_counter()
            baseline = await complete(stub, make_request(prompt, NEW_TOKENS, draft_tokens=0, ignore_eos=True))
            baseline_s = time.perf_counter() - started
            speculative = await complete(stub, make_request(prompt, NEW_TOKENS, draft_tokens=4, ignore_eos=True))
            assert speculative.token_ids == baseline.token_ids, prompt
            assert len(baseline.token_ids) == NEW_TOKENS
            assert speculative.final.stats.drafted > 0 and baseline.final.stats.drafted == 0
            # speculation off, the target decodes in runs (fewer calls than tokens, generation.py),
            # and every call crossed the proxy: at least one RTT each
            assert baseline.final.stats.steps < NEW_TOKENS
            assert baseline_s >= baseline.final.stats.steps * RTT_MS / 1000
            assert speculative.final.stats.network_seconds >= speculative.final.stats.steps * RTT_MS / 1000 * 0.9


def lab_config(tiny_dirs, namespaces: bool) -> LabConfig:
    return LabConfig(
        draft_model=str(tiny_dirs["draft"]),
        target_model=str(tiny_dirs["target"]),
        dtype="float32",
        rtt_ms=RTT_MS,
        namespaces=namespaces,
    )


@pytest.mark.timeout(300)
async def test_lab_across_network_namespaces(tiny_dirs):
    refused = namespaces_refused()
    if refused:
        print(f"network namespaces refused: {refused}")
        pytest.skip(f"network namespaces refused ({refused}); test_lab_on_loopback runs the same path")
    lab = Lab(lab_config(tiny_dirs, namespaces=True))
    try:
        async with lab:
            await lab.deploy()
            hosts = lab.hosts
            assert len({host.ip for host in hosts.values()}) == 3
            assert lab.deployed["orchestrator-0"][0].startswith(f"{hosts['orchestrator'].ip}:")
            await check_lab(lab, hosts["draft"].ip, hosts["target"].ip)
    finally:
        assert_torn_down(lab)


@pytest.mark.timeout(300)
async def test_lab_on_loopback(tiny_dirs):
    lab = Lab(lab_config(tiny_dirs, namespaces=False))
    try:
        async with lab:
            await lab.deploy()
            machine = lab.hosts["orchestrator"].ip
            await check_lab(lab, machine, machine)
    finally:
        assert_torn_down(lab)


def assert_torn_down(lab: Lab) -> None:
    """No process, namespace or bridge of the lab is left."""
    assert all(node.poll() is not None for node in lab.ray_nodes)
    assert lab.up is None or lab.up.returncode is not None
    assert not lab.workdir.exists()
    if lab.network:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        assert not any(netns in names for netns in lab.network.netns)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
        assert lab.network.bridge not in links
    else:  # on namespaced hosts the printed pids are the hosts' own, and the hosts are gone
        assert not [pid for _, pid in lab.deployed.values() if process_alive(pid)]
