"""A deployment without a draft service (issue 16: "a draft service with only lookup drafters loads
no model"). The lookup drafters (ngram: prompt lookup, suffix) guess in the orchestrator and never
call a draft, so an orchestrator started without --draft serves them over the target alone: greedy
output equals speculation off, lookup steps happen, and a request for a drafter that needs the draft
model (model, hybrid) is refused at the boundary. `specd up --drafter suffix` starts no draft process.

Real gRPC servers on port 0 and real Ray, tiny models (conftest.py)."""

import json
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest
from test_drafters import REPEATS, with_drafter
from test_openai_api import http, scrape
from test_orchestrator import generate, request

from specd.cli import main
from specd.deploy import cluster
from specd.deploy.local import Child, LocalStack, StackConfig
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.server import OrchestratorServer
from specd.proto.limits import Limits
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier
from specd.v1 import common_pb2, specdecode_pb2_grpc

NEW_TOKENS = 48


class TargetOnly:
    """A tiny target service and an orchestrator on Ray over it alone (no --draft), its HTTP API too."""

    async def start(self, target_loaded) -> "TargetOnly":
        limits = Limits(max_sessions=16)
        self.target = create_target_server(lambda: Verifier(TransformersEngine(target_loaded), limits))
        await self.target.start("127.0.0.1:0")
        await self.target.load()
        self.orchestrator = OrchestratorServer(None, f"127.0.0.1:{self.target.port}", workers=1, drafter="suffix")
        await self.orchestrator.start("127.0.0.1:0")
        self.base = f"http://127.0.0.1:{await self.orchestrator.start_http('127.0.0.1', 0)}"
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.orchestrator.port}")
        self.client = specdecode_pb2_grpc.SpecDecodeStub(self.channel)
        return self

    async def stop(self) -> None:
        await self.channel.close()
        await self.orchestrator.stop(0)
        await self.target.stop(0)


@pytest.fixture(scope="module")
async def target_only(tiny_loaded, ray_local):
    stack = await TargetOnly().start(tiny_loaded["target"])
    yield stack
    await stack.stop()


async def test_greedy_output_with_each_lookup_drafter_and_no_draft_is_the_targets(target_only):
    baseline, _, _ = await generate(target_only.client, request(REPEATS, 0, max_new_tokens=NEW_TOKENS))
    for drafter in ("suffix", "ngram"):
        for k in (None, 3):
            message = with_drafter(request(REPEATS, k, max_new_tokens=NEW_TOKENS), drafter)
            tokens, _, final = await generate(target_only.client, message)
            assert tokens == baseline, (drafter, k)
            stats = final.stats
            assert stats.drafter == drafter
            # every guess is the lookup's, and text that repeats has some
            assert stats.lookup_drafted == stats.drafted > 0, (drafter, k)
            assert stats.lookup_steps == stats.drafting_steps > 0


async def test_sampled_lookup_guesses_without_a_draft_go_to_the_target_with_a_one_hot_q(target_only):
    """top_k = 1: p is one-hot at the target's argmax, so a sampled request must equal greedy's; no
    draft bounds K by its q rows (a lookup's rows are one-hot)."""
    greedy, _, _ = await generate(target_only.client, request(REPEATS, 0, max_new_tokens=40))
    message = with_drafter(request(REPEATS, 3, max_new_tokens=40, temperature=1.0, top_k=1, seed=5), "ngram")
    tokens, _, final = await generate(target_only.client, message)
    assert tokens == greedy
    assert final.stats.lookup_drafted == final.stats.drafted and final.stats.lookup_accepted == final.stats.accepted > 0


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
async def test_a_drafter_that_needs_the_draft_model_is_refused(target_only, drafter):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(target_only.client, with_drafter(request("def f(x):", 3), drafter))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "without a draft service" in refused.value.details() and drafter in refused.value.details()
    model = target_only.orchestrator.http.api.model_name
    body = {"model": model, "prompt": "def f(x):", "max_tokens": 4, "specd": {"drafter": drafter}}
    status, text = await http("POST", f"{target_only.base}/v1/completions", body)
    assert status == 400 and "without a draft service" in json.loads(text)["error"]["message"]


async def test_draft_ahead_on_has_nothing_to_draft_with_and_is_ignored(target_only):
    message = with_drafter(request(REPEATS, 3, max_new_tokens=16), "suffix")
    message.draft_ahead = "on"
    _, _, final = await generate(target_only.client, message)
    assert final.stats.ahead_steps == 0 and final.stats.steps > 0


async def test_info_health_and_metrics_report_the_target_alone(target_only):
    info = await target_only.client.Info(common_pb2.InfoRequest())
    assert not info.HasField("draft")
    assert info.target.role == "target" and info.drafter == "suffix"
    status, _ = await http("GET", f"{target_only.base}/health")
    assert status == 200
    models = json.loads((await http("GET", f"{target_only.base}/v1/models"))[1])
    model = models["data"][0]["id"]
    body = {"model": model, "prompt": REPEATS, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    body["specd"] = {"draft_tokens": 3}  # the server's default drafter: suffix
    status, text = await http("POST", f"{target_only.base}/v1/completions", body)
    assert status == 200, text
    metrics = scrape((await http("GET", f"{target_only.base}/metrics"))[1])
    assert metrics["specd_spec_decode_lookup_num_drafts_total"] > 0
    assert metrics["specd_spec_decode_lookup_num_drafts_total"] == metrics["specd_spec_decode_num_drafts_total"]


def test_an_orchestrator_without_a_draft_refuses_a_default_drafter_that_needs_one(capsys):
    with pytest.raises(ValueError, match="needs --draft"):
        OrchestratorServer(None, "127.0.0.1:1", drafter="hybrid")
    # the command line: one line and exit status 2, before Ray or any connection (hybrid is the default)
    assert main(["serve", "orchestrator", "--target", "127.0.0.1:1", "--no-http", "--no-metrics"]) == 2
    assert "--drafter hybrid guesses with the draft model" in capsys.readouterr().err
    assert main(["serve", "orchestrator", "--draft", "", "--target", "127.0.0.1:1", "--drafter", "model"]) == 2
    assert "--drafter ngram or suffix" in capsys.readouterr().err


@pytest.mark.parametrize(
    "drafter, services", [("suffix", ["target"]), ("ngram", ["target"]), (None, ["draft", "target"])]
)
async def test_a_stack_here_starts_a_draft_only_for_a_drafter_that_asks_it(monkeypatch, drafter, services):
    """LocalStack's `specd serve` command lines, nothing started; the orchestrator gets --draft only with a draft."""
    spawned: dict[str, list[str]] = {}

    def spawn(self, name, port, metrics_port, serve_args, env=None):
        spawned[name] = serve_args
        return Child(name, f"127.0.0.1:{len(spawned)}", process=None, log=Path(""))

    async def wait(self, child):
        pass

    monkeypatch.setattr(LocalStack, "_spawn", spawn)
    monkeypatch.setattr(LocalStack, "_wait", wait)
    await LocalStack(StackConfig(drafter=drafter), say=lambda message: None).start()
    assert sorted(spawned) == sorted([*services, "orchestrator"])
    assert ("--draft" in spawned["orchestrator"]) == ("draft" in services)


@pytest.mark.parametrize("drafter, services", [("suffix", ["target"]), ("hybrid", ["draft", "target"])])
async def test_a_cluster_deploys_a_draft_only_for_a_drafter_that_asks_it(monkeypatch, drafter, services):
    """`specd up --ray-address`: which service actors ClusterStack starts, and what each replica dials
    (the actors themselves, and Ray, left out)."""
    started, dialled = [], []

    async def start_service(self, role, resources, replica=0):
        started.append(role)
        return cluster.Deployed(role, None, address=f"{role}-node:{replica + 1}")

    async def start_orchestrator(self, index, draft_address, target_address, resources):
        dialled.append((draft_address, target_address))

    monkeypatch.setattr(cluster.ClusterStack, "_start_service", start_service)
    monkeypatch.setattr(cluster.ClusterStack, "_start_orchestrator", start_orchestrator)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [{}])
    config = cluster.ClusterConfig("auto", drafter=drafter, replicas=2)
    await cluster.ClusterStack(config, say=lambda message: None).start()
    assert sorted(started) == services
    draft = "draft-node:1" if "draft" in services else None
    assert dialled == [(draft, "target-node:1")] * 2


def test_specd_up_with_a_lookup_drafter_starts_no_draft_service(tiny_dirs, tmp_path):
    """The real command: a target and an orchestrator, no draft process and no draft line; a request
    the suffix drafter guesses for equals speculation off."""
    from test_up import read_until_ready, stop

    from specd.deploy.local import free_port

    ports = [free_port() for _ in range(4)]
    command = [sys.executable, "-m", "specd.cli", "up", "--drafter", "suffix", "--dtype", "float32", "--workers", "1"]
    command += ["--target-model", str(tiny_dirs["target"]), "--device", "cpu", "--cuda-graphs", "off"]
    command += ["--port", str(ports[0]), "--http-port", str(ports[1])]
    command += ["--metrics-port", str(ports[2]), "--target-metrics-port", str(ports[3])]
    log = tmp_path / "up.log"
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), stdin=subprocess.DEVNULL, text=True)
    children: list[psutil.Process] = []
    try:
        lines = read_until_ready(up, log)
        children = psutil.Process(up.pid).children()
        roles = sorted(child.cmdline()[child.cmdline().index("serve") + 1] for child in children)
        assert roles == ["orchestrator", "target"]
        assert "--draft" not in next(c for c in children if "orchestrator" in c.cmdline()).cmdline()
        assert not any(line.startswith("draft") for line in lines), lines
        assert any(line.startswith("target") and "cpu" in line for line in lines), lines
        with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:  # sync: this test has no event loop
            client = specdecode_pb2_grpc.SpecDecodeStub(channel)
            off, _ = generate_sync(client, request(REPEATS, 0, max_new_tokens=32))
            suffix, stats = generate_sync(client, request(REPEATS, 3, max_new_tokens=32))
        assert suffix == off and stats.drafter == "suffix" and stats.lookup_drafted == stats.drafted > 0
    finally:
        stop(up)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, "specd up must stop its services"


def generate_sync(client, message) -> tuple[list[int], object]:
    """The output tokens and stats of one request, over a synchronous channel."""
    tokens, final = [], None
    for reply in client.Generate(message):
        tokens += reply.delta.token_ids
        final = reply.final if reply.HasField("final") else final
    return tokens, final.stats
