"""`specd up` as a user runs it, on the tiny pair: three processes, started once for this module.
It prints the HTTP and metrics addresses and they answer; each model service gets its share of the
cores (issue 21) and the device flags (issue 15), and prints where it computes; SIGTERM stops all
three. The flag handling without processes is tests/test_up_cores.py's and tests/test_device_cli.py's."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from test_device_cli import assert_on_the_cpu, command_line, info_of
from test_openai_api import PROMPT, http

from specd.deploy.local import SHARED_CORES_ENV, free_port, share_cores, usable_cores

PORT_FLAGS = ("--port", "--http-port", "--draft-port", "--target-port")
PORT_FLAGS += ("--metrics-port", "--draft-metrics-port", "--target-metrics-port")


@dataclass
class Up:
    """A running `specd up`: its flags' ports, what it printed up to `ready:`, its three children."""

    process: subprocess.Popen
    ports: dict[str, int]
    lines: list[str] = field(default_factory=list)
    services: dict[str, psutil.Process] = field(default_factory=dict)


@pytest.fixture(scope="module")
def up(tiny_dirs, tmp_path_factory):
    """No --threads (the rule's share) and no OMP_WAIT_POLICY of this process's: what the children get
    is specd up's own doing. On the CPU (--device cpu) whatever this machine has."""
    ports = {flag: free_port() for flag in PORT_FLAGS}
    command = [sys.executable, "-m", "specd.cli", "up", "--dtype", "float32", "--workers", "1"]
    command += ["--draft-model", str(tiny_dirs["draft"]), "--target-model", str(tiny_dirs["target"])]
    command += ["--device", "cpu", "--draft-device", "cpu", "--cuda-graphs", "off"]
    command += [str(item) for pair in ports.items() for item in pair]
    env = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    log = tmp_path_factory.mktemp("up") / "up.log"
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=log.open("w"), stdin=subprocess.DEVNULL, text=True, env=env
    )
    up = Up(process, ports)
    try:
        up.lines = read_until_ready(process, log)
        for child in psutil.Process(process.pid).children():
            argv = command_line(child)
            if "serve" in argv:
                up.services[argv[argv.index("serve") + 1]] = child
        assert sorted(up.services) == ["draft", "orchestrator", "target"], up.services
        yield up
    finally:
        stop(process)
    gone, alive = psutil.wait_procs(list(up.services.values()), timeout=30)
    assert not alive, "specd up must stop its services"


def read_until_ready(process: subprocess.Popen, log: Path, timeout_s: float = 240) -> list[str]:
    """What `specd up` printed on stdout up to its `ready:` line (its stderr goes to `log`)."""
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline and (line := process.stdout.readline()):
        lines.append(line.rstrip())
        if line.startswith("ready:"):
            break
    assert lines and lines[-1].startswith("ready:"), "\n".join(lines) + log.read_text()[-3000:]
    return lines


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, as a user's Ctrl-C or a supervisor sends it: `specd up` stops its three processes."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_specd_up_prints_http_and_metrics_addresses_and_serves_them(up):
    """The printed addresses answer."""
    printed = "\n".join(up.lines)
    base = f"http://127.0.0.1:{up.ports['--http-port']}/v1"
    assert base in printed, printed
    for flag in ("--metrics-port", "--draft-metrics-port", "--target-metrics-port"):
        assert f"http://127.0.0.1:{up.ports[flag]}/metrics" in printed
    status, text = asyncio.run(
        http("POST", f"{base}/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    )
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] <= 6
    status, text = asyncio.run(http("GET", f"http://127.0.0.1:{up.ports['--metrics-port']}/metrics"))
    assert 'specd_requests_total{api="http",outcome=' in text
    status, text = asyncio.run(http("GET", f"http://127.0.0.1:{up.ports['--target-metrics-port']}/metrics"))
    # Verify where the request speculated, Decode where its first steps were priced target-only
    # (the tiny test pair's draft costs about what its target does: model/pass_profile.py)
    assert re.search(r'specd_service_calls_total\{code="OK",method="(Verify|Decode)"\} [1-9]', text), text


def test_specd_up_starts_its_services_with_their_share_of_the_cores(up):
    """The children's command lines carry the threads the rule gives on this machine, and their
    environment OMP_WAIT_POLICY=PASSIVE; the orchestrator gets neither."""
    expected = share_cores(usable_cores())
    for role in ("draft", "target"):
        argv = up.services[role].cmdline()
        assert "--threads" in argv, argv
        assert int(argv[argv.index("--threads") + 1]) == expected[role], (role, argv)
        assert up.services[role].environ().get("OMP_WAIT_POLICY") == SHARED_CORES_ENV["OMP_WAIT_POLICY"]
    assert "--threads" not in up.services["orchestrator"].cmdline()
    assert "OMP_WAIT_POLICY" not in up.services["orchestrator"].environ()


def test_the_printed_line_says_how_many_positions_an_engine_call_scores_where_it_is_bounded():
    """ModelInfo.scored_per_call (llama.cpp bitwise: 63 with the patched ggml-cpu, 3 without) is on the
    line `specd up` prints for each service; an engine without such a bound (0) adds nothing."""
    from specd.cli.up import describe_device
    from specd.v1 import common_pb2

    info = common_pb2.ModelInfo(role="target", device="cpu", dtype="gguf", pass_seconds=[0.027, 0.04, 0.06, 0.087])
    assert describe_device(info).endswith("; 1 / 4 scored positions 27 / 87 ms")
    info.scored_per_call = 63
    assert describe_device(info).endswith("; 1 / 4 scored positions 27 / 87 ms; up to 63 scored a call")


def test_specd_up_passes_the_devices_on_and_prints_where_each_service_computes(up):
    for role in ("draft", "target"):
        argv = " ".join(command_line(up.services[role]))
        assert "--device cpu" in argv and "--cuda-graphs off" in argv, argv
        printed = [line for line in up.lines if line.split()[:1] == [role] and " cpu (" in line]
        # e.g. "target        cpu (AMD EPYC), float32, host memory 21.3 of 23.5 GiB free; 1 / 4 scored
        # positions 25 / 91 ms" (what the service measured of its passes when it loaded: model/pass_profile.py)
        assert len(printed) == 1, up.lines
        assert " memory " in printed[0] and " GiB free" in printed[0]
        assert "; 1 / 4 scored positions " in printed[0] and printed[0].endswith(" ms"), printed[0]
    assert ", float32, host memory " in next(
        line for line in up.lines if line.startswith("target ") and " cpu (" in line
    )
    assert_on_the_cpu(asyncio.run(info_of("target", f"127.0.0.1:{up.ports['--target-port']}")))
