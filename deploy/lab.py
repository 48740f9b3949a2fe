"""A network lab on one machine: draft, target and orchestrator as three hosts of one Ray cluster.

Namespaced (as root): each host is a process tree in its own network, mount and pid namespaces
(named with `ip netns attach`, so `ip netns exec` reaches it), a veth on a shared bridge, its
own address and a private /tmp/ray, like a separate machine; killing the host's init ends
everything started in it. Loopback (where namespaces are refused): the three hosts are one Ray
node on this machine's address offering all three resources (traffic stays on loopback). Either way:

1. `ray start --head` on the orchestrator host, `ray start --address` on the draft and target
   hosts, each offering its role as a custom Ray resource;
2. delay proxies on the router (the bridge's address, or 127.0.0.1) in front of the draft and
   target gRPC ports, adding `rtt_ms` to every round trip the orchestrator makes to them;
3. `specd up --ray-address` on the orchestrator host, told to dial the services via the proxies.

Cores (namespaced only): `LabConfig.cpus` pins each host to CPUs of its own (`taskset` on everything
started in it: its Ray node, and so the actors Ray forks there), so that draft and target do not
slow each other down, as on separate machines (`split_cores`). What stays shared is what one
machine cannot split: the last-level cache, memory bandwidth and the kernel's network stack (the
veths and the bridge cost microseconds; the delay proxies add the RTT), so a memory-bound pair
still slows each other a little where two machines would not.
"""

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specd.deploy.delay_proxy import DelayProxy
from specd.deploy.local import REPLICA_PORT_STEP, free_port
from specd.orchestrator.remote import wait_until_serving

ROLES = ("orchestrator", "draft", "target")  # the orchestrator host runs the Ray head
RAY = str(Path(sys.executable).with_name("ray"))


@dataclass
class Host:
    name: str  # its role
    ip: str
    init_pid: int | None = None  # the namespaced host's init process; None = this machine itself
    cpus: str | None = None  # the CPUs (taskset list, e.g. "0-3") everything on it runs on; None: all

    def command(self, argv: list[str]) -> list[str]:
        """argv as run on this host (on its CPUs: affinity passes to every process it starts)."""
        pinned = ["taskset", "-c", self.cpus, *argv] if self.cpus else list(argv)
        if self.init_pid is None:
            return pinned
        return ["nsenter", "-t", str(self.init_pid), "-n", "-m", "-p", "--", *pinned]


def split_cores(cpus: list[int] | None = None) -> dict[str, str]:
    """Each host's CPUs: the target the first half (rounded up), the draft the rest, the orchestrator
    with the draft (it waits on both, and computes little); taskset lists, as LabConfig.cpus takes them.
    One CPU cannot be split: then everything shares it."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    half = (len(cpus) + 1) // 2
    target, draft = ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))
    return {"target": target, "draft": draft, "orchestrator": draft}


def namespaces_refused() -> str | None:
    """Why this machine cannot build the namespaced lab, or None when it can."""
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_NET_ADMIN)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--pid", "--fork", "true"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        return f"unshare refused: {probe.stderr.strip()}"
    return None


class NamespacedNetwork:
    """Hosts as namespaces on one bridge; the bridge's address is the router's."""

    def __init__(self):
        self.tag = secrets.token_hex(2)  # unique names: two labs may run at once
        self.bridge = f"sd{self.tag}br"
        self.subnet = _free_subnet()
        self.router_ip = f"{self.subnet}.1"
        self.inits: list[subprocess.Popen] = []
        self.netns: list[str] = []

    def create(self, names, cpus: dict[str, str] | None = None) -> dict[str, Host]:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.router_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return {name: self._host(index, name, (cpus or {}).get(name)) for index, name in enumerate(names)}

    def _host(self, index: int, name: str, cpus: str | None = None) -> Host:
        init = subprocess.Popen(
            [
                "unshare",
                "--net",
                "--mount",
                "--pid",
                "--fork",
                "--mount-proc",
                "--propagation",
                "private",
                "sh",
                "-c",
                "mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray && exec sleep infinity",
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.inits.append(init)
        pid = _forked_child(init.pid)
        netns, veth, ip = f"specd-{self.tag}-{name}", f"sd{self.tag}v{index}", f"{self.subnet}.{index + 2}"
        _ip("netns", "attach", netns, str(pid))
        self.netns.append(netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        for args in (
            ("addr", "add", f"{ip}/24", "dev", "eth0"),
            ("link", "set", "eth0", "up"),
            ("link", "set", "lo", "up"),
            ("route", "add", "default", "via", self.router_ip),
        ):
            _ip("-n", netns, *args)
        return Host(name, ip, pid, cpus)

    def destroy(self) -> None:
        """SIGKILL each host's init (the kernel then ends every process in it), then the names and the bridge."""
        for init in self.inits:
            pid = _forked_child(init.pid, timeout_s=0)
            if pid:
                os.kill(pid, signal.SIGKILL)
            init.kill()
            init.wait()
        time.sleep(1)  # the closed sockets' FIN/RST still cross the bridge: no orphan keeps a namespace alive
        for netns in self.netns:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _forked_child(pid: int, timeout_s: float = 5.0) -> int | None:
    """The process `unshare --fork` started: the namespaced host's init."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        if children:
            return int(children[0])
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def _free_subnet() -> str:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=False).stdout
    for _ in range(100):
        subnet = f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(256)}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet for the lab")


@dataclass
class LabConfig:
    draft_model: str = "draft"
    target_model: str = "target"
    dtype: str | None = None
    rtt_ms: float = 0.0  # added to every orchestrator -> draft/target round trip
    namespaces: bool = True  # False: the loopback variant
    up_flags: list[str] = field(default_factory=list)  # more `specd up` flags
    cpus: dict[str, str] = field(default_factory=dict)  # role -> its host's CPUs (split_cores); namespaced only
    target_replicas: int = 1  # on the target host, each behind a proxy of its own (`proxies["target-<i>"]`)


class Lab:
    def __init__(self, config: LabConfig, say=lambda message: print(message, file=sys.stderr, flush=True)):
        if config.cpus and not config.namespaces:
            raise ValueError("per-host CPUs need the namespaced lab: the loopback lab's hosts are one Ray node")
        self.config = config
        self.say = say
        self.workdir = Path(tempfile.mkdtemp(prefix="specd-lab-"))
        self.network = NamespacedNetwork() if config.namespaces else None
        self.hosts: dict[str, Host] = {}
        self.ray_nodes: list[subprocess.Popen] = []
        self.proxies: dict[str, DelayProxy] = {}
        self.up: asyncio.subprocess.Process | None = None
        self.deployed: dict[str, tuple[str, int]] = {}  # name -> (address, pid), as `specd up` printed them
        self.address = ""  # the orchestrator's gRPC address, once deployed

    async def __aenter__(self) -> "Lab":
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    @property
    def router_ip(self) -> str:
        return self.network.router_ip if self.network else "127.0.0.1"

    def set_rtt(self, rtt_ms: float) -> None:
        for proxy in self.proxies.values():
            proxy.rtt_ms = rtt_ms

    async def start(self) -> None:
        started = time.monotonic()
        if self.network:
            self.hosts = self.network.create(ROLES, self.config.cpus)
        else:  # Ray resolves 127.0.0.1 to this machine's address, so use that one from the start
            import ray

            self.hosts = {name: Host(name, ray.util.get_node_ip_address()) for name in ROLES}
        head = self.hosts["orchestrator"]
        head_address = f"{head.ip}:{free_port()}"
        await self._ray_start(head, ["--head", "--port", head_address.rsplit(":", 1)[1]])
        if self.network:
            await asyncio.gather(
                *(self._ray_start(self.hosts[name], ["--address", head_address]) for name in ("draft", "target"))
            )
        self.head_address = head_address
        self.say(
            f"lab: {len(self.ray_nodes)} Ray node(s) up in {time.monotonic() - started:.0f} s; "
            + ", ".join(
                f"{host.name} {host.ip}" + (f" cpus {host.cpus}" if host.cpus else "") for host in self.hosts.values()
            )
        )

    async def _ray_start(self, host: Host, role_flags: list[str]) -> None:
        """`ray start --block` on `host`, offering its role (all three on a loopback lab) as a resource."""
        roles = [host.name] if self.network else list(ROLES)
        log = self.workdir / f"ray-{host.name}.log"
        argv = [
            RAY,
            "start",
            "--block",
            *role_flags,
            "--node-ip-address",
            host.ip,
            "--resources",
            json.dumps({role: 1 for role in roles}),
            "--object-store-memory",
            str(100 * 2**20),
            "--disable-usage-stats",
            # explicit ports and temp dir: a loopback lab shares this machine with other Ray instances
            "--dashboard-agent-listen-port",
            str(free_port()),
            "--temp-dir",
            str(self.workdir / f"ray-{host.name}"),
        ]
        if "--head" in role_flags:
            argv += [
                "--include-dashboard=false",
                "--dashboard-port",
                str(free_port()),
                "--ray-client-server-port",
                str(free_port()),
            ]
        node = subprocess.Popen(
            host.command(argv),
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=_clean_env(),
        )
        self.ray_nodes.append(node)
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if node.poll() is not None:
                raise RuntimeError(f"ray start on the {host.name} host failed:\n{_tail(log)}")
            await asyncio.sleep(0.2)

    async def deploy(self) -> str:
        """Proxies, then `specd up --ray-address` on the orchestrator host; returns the orchestrator's address."""
        config = self.config
        ports = {name: free_port() for name in ("draft", "target", "port", "http", "metrics", "dm", "tm")}
        for role, count in (("draft", 1), ("target", config.target_replicas)):
            vias = []
            for replica in range(count):  # replica i listens on the role's port + REPLICA_PORT_STEP i
                name = role if replica == 0 else f"{role}-{replica}"
                upstream = f"{self.hosts[role].ip}:{ports[role] + REPLICA_PORT_STEP * replica}"
                self.proxies[name] = DelayProxy(upstream, config.rtt_ms)
                vias.append(await self.proxies[name].start(self.router_ip))
            ports[f"{role}_via"] = ",".join(vias)
        argv = [
            sys.executable,
            "-m",
            "specd.cli",
            "up",
            "--ray-address",
            self.head_address,
            "--draft-model",
            config.draft_model,
            "--target-model",
            config.target_model,
            "--draft-port",
            str(ports["draft"]),
            "--target-port",
            str(ports["target"]),
            "--draft-address",
            ports["draft_via"],
            "--target-address",
            ports["target_via"],
            "--port",
            str(ports["port"]),
            "--http-port",
            str(ports["http"]),
            "--metrics-port",
            str(ports["metrics"]),
            "--draft-metrics-port",
            str(ports["dm"]),
            "--target-metrics-port",
            str(ports["tm"]),
            *(["--target-replicas", str(config.target_replicas)] if config.target_replicas > 1 else []),
            *(["--dtype", config.dtype] if config.dtype else []),
            *config.up_flags,
        ]
        log = self.workdir / "specd-up.log"
        self.up = await asyncio.create_subprocess_exec(
            *self.hosts["orchestrator"].command(argv),
            stdout=asyncio.subprocess.PIPE,
            stderr=log.open("w"),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=_clean_env(),
        )
        await self._read_deployment(log)
        self.address = self.deployed["orchestrator-0"][0]
        await wait_until_serving(self.address, timeout_s=60)
        return self.address

    async def _read_deployment(self, log: Path) -> None:
        """Parse `specd up`'s address lines until its `ready:` line."""
        while line := (await self.up.stdout.readline()).decode():
            if line.startswith("ready:"):
                return
            if match := re.match(r"(\S+)\s+(\S+:\d+)\s+pid (\d+)", line):
                self.deployed[match[1]] = (match[2], int(match[3]))
        await self.up.wait()
        raise RuntimeError(f"specd up exited with code {self.up.returncode}:\n{_tail(log, 30)}")

    async def stop(self) -> None:
        """Everything the lab started ends, whatever state it is in."""
        for proxy in self.proxies.values():
            await proxy.stop()
        if self.network:
            self.network.destroy()  # ends every process on every host at once
        if self.up:  # on a loopback lab: lets `specd up` remove its actors first
            await _stop_group(self.up.pid, self.up.wait, grace_s=15)
        for node in self.ray_nodes:
            await _stop_group(node.pid, lambda node=node: asyncio.to_thread(node.wait), grace_s=2)
        if not self.network:  # the actors' processes are Ray's workers, in groups of their own
            await _stop_pids([pid for _, pid in self.deployed.values()], grace_s=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


async def _stop_group(pgid: int, wait, grace_s: float) -> None:
    """SIGTERM a process group the lab started; after grace_s, SIGKILL what is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wait(), grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)  # the leader may be gone while Ray's children are not
    await wait()


async def _stop_pids(pids: list[int], grace_s: float) -> None:
    """Wait up to grace_s for these processes to end, then SIGKILL what is left: a Ray worker ends on
    its own once its raylet is gone, but only when it next looks (a loaded machine took longer than the
    lab's checks allowed: the full suite once found an actor's process alive after stop)."""
    deadline = time.monotonic() + grace_s
    while (alive := [pid for pid in pids if process_alive(pid)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while any(process_alive(pid) for pid in alive) and time.monotonic() < deadline + grace_s:
        await asyncio.sleep(0.05)


def _clean_env() -> dict:
    """This environment without RAY_ADDRESS (the lab names its cluster explicitly), unbuffered output,
    and Ray's token auth on for every node and driver (they share this machine's ~/.ray/auth_token)."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(PYTHONUNBUFFERED="1", RAY_AUTH_MODE="token")
    return env


def process_alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
