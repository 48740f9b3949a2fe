"""Models on their device (issue 15): every test runs on the CPU, and again on CUDA where a GPU is
visible (marker `gpu`; scripts/gpu_check.sh runs them there). Real gRPC services on real ports,
real engines: only the device changes."""

import signal
import subprocess
import sys

import grpc
import pytest
import torch
from conftest import DEVICES, GPU, requires_gpu, start_services

from specd.deploy.local import free_port
from specd.draft_service.drafter import Drafter, ProposeCall
from specd.model.devices import DeviceUnavailable, resolve_device
from specd.model.engine import Row
from specd.model.errors import CapacityExceeded
from specd.model.sampling import Sampling
from specd.model.sessions import Cursor
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.generation import Generation, GenerationRequest
from specd.orchestrator.remote import wait_until_serving
from specd.proto.contract import fingerprint
from specd.proto.limits import AUTO_PREFIX_TOKENS, Limits
from specd.serving.messages import q_row_from_proto, q_row_to_proto
from specd.target_service.verifier import Verifier, VerifyCall
from specd.v1 import common_pb2, target_pb2_grpc

PROMPTS = [list(range(1000, 1009)), list(range(2000, 2004)), list(range(3000, 3015))]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(params=[False, True], ids=["eager", "static-slot"])
def graphs(request) -> bool:
    return request.param


# -- choosing a device -------------------------------------------------------------------------


def test_auto_puts_the_target_on_a_gpu_when_there_is_one_and_the_draft_on_the_cpu():
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert str(resolve_device("target", "auto")) == expected
    assert str(resolve_device("draft", "auto")) == "cpu"
    assert str(resolve_device("draft", "cpu")) == str(resolve_device("target", "CPU")) == "cpu"


@pytest.mark.parametrize("choice", ["tpu", "cuda:x", "gpu0"])
def test_an_unknown_device_is_refused_in_one_line(choice):
    with pytest.raises(DeviceUnavailable) as refused:
        resolve_device("target", choice)
    assert "\n" not in str(refused.value) and choice in str(refused.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cuda_without_a_gpu_is_refused_in_one_line():
    with pytest.raises(DeviceUnavailable, match="no CUDA GPU is visible") as refused:
        resolve_device("target", "cuda")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)])
def test_a_gpu_past_the_last_one_is_refused(device):
    with pytest.raises(DeviceUnavailable, match="visible"):
        resolve_device("target", f"cuda:{torch.cuda.device_count()}")


# -- the model services on the device ----------------------------------------------------------


def test_the_kv_budget_comes_from_device_memory_when_no_limit_is_given(tiny_on, device):
    engine = TransformersEngine(tiny_on(device)["target"])
    service = Verifier(engine, Limits(max_cached_tokens=0))
    if device == "cpu":
        assert engine.kv_token_budget() is None and service.limits.max_cached_tokens == Limits().max_cached_tokens
    else:
        free, _ = torch.cuda.mem_get_info()
        per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, float32
        assert 0 < service.limits.max_cached_tokens <= free // per_token
    assert Verifier(engine, Limits(max_cached_tokens=1234)).limits.max_cached_tokens == 1234


@pytest.mark.parametrize("prefix", [AUTO_PREFIX_TOKENS, 1000, 0])
def test_on_a_device_whose_kv_the_prefix_cache_shares_its_tokens_come_out_of_the_automatic_budget(
    tiny_loaded, monkeypatch, prefix
):
    """A GPU's budget, as the transformers engine reports it there (stood in for on a CPU): the
    sessions and the prefix cache's copies split it, never both the whole of it."""
    monkeypatch.setattr(TransformersEngine, "kv_token_budget", lambda engine: 100_000)
    limits = Verifier(
        TransformersEngine(tiny_loaded["target"]), Limits(max_cached_tokens=0, prefix_cache_tokens=prefix)
    ).limits
    expected_prefix = 16_384 if prefix == AUTO_PREFIX_TOKENS else prefix
    assert (limits.prefix_cache_tokens, limits.max_cached_tokens) == (expected_prefix, 100_000 - expected_prefix)


def prefilled(service):
    """The service with every prompt but its last token cached, one session each."""
    for index, prompt in enumerate(PROMPTS):
        service.prefill(Cursor(f"s{index}", 0, 0, prompt[:-1]))
    return service


def continuation(index: int) -> Cursor:
    prompt = PROMPTS[index]
    return Cursor(f"s{index}", len(prompt) - 1, fingerprint(prompt[:-1]), prompt[-1:])


def verify_calls(sampling: Sampling, drafts: list[list[int]], q_rows=None) -> list[VerifyCall]:
    return [VerifyCall(continuation(i), draft, q_rows[i] if q_rows else [], sampling) for i, draft in enumerate(drafts)]


@pytest.mark.parametrize(
    "sampling", [Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=7)], ids=["greedy", "seeded"]
)
def test_a_batched_verify_equals_one_call_at_a_time(tiny_on, device, graphs, sampling):
    """Drafted on the device (q rows through the wire format), verified in one pass and one by one."""
    loaded = tiny_on(device)
    drafter = prefilled(Drafter(TransformersEngine(loaded["draft"], graphs), Limits()))
    proposals = [drafter.propose(ProposeCall(continuation(i), 4, sampling)) for i in range(len(PROMPTS))]
    drafts = [proposal.draft_tokens for proposal in proposals]
    q_rows = [[q_row_from_proto(q_row_to_proto(*row)) for row in proposal.q] for proposal in proposals]
    if not sampling.greedy:
        assert all(len(rows) == 4 and rows[0][0].device.type == "cpu" for rows in q_rows)  # pruned rows, on the host
    batched = prefilled(Verifier(TransformersEngine(loaded["target"], graphs), Limits()))
    together = batched.verify_batch(verify_calls(sampling, drafts, q_rows if not sampling.greedy else None))
    alone = prefilled(Verifier(TransformersEngine(loaded["target"], graphs), Limits()))
    for call, result in zip(verify_calls(sampling, drafts, q_rows if not sampling.greedy else None), together):
        single = alone.verify(call)
        assert (result.accepted, result.emitted_tokens, result.cached_tokens) == (
            single.accepted,
            single.emitted_tokens,
            single.cached_tokens,
        )


async def generate(services, k: int | None, sampling: dict, max_new_tokens: int = 24) -> list[int]:
    request = GenerationRequest(PROMPTS[2], max_new_tokens, draft_tokens=k, ignore_eos=True, **sampling)
    generation = Generation(request, services.draft, services.target, _Tokenless(), set())
    tokens = []
    async for event in generation.run():
        tokens += getattr(event, "token_ids", [])
    return tokens


class _Tokenless:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + token % 26) for token in ids)


async def test_greedy_speculation_equals_target_only_and_seeded_sampling_repeats(tiny_on, device, graphs):
    """Both services on the device, over real gRPC: every K gives the target-only tokens; a seeded
    sampled request gives the same tokens twice."""
    loaded = tiny_on(device)
    services = await start_services(loaded["draft"], loaded["target"], Limits(max_sessions=8), graphs=graphs)
    try:
        target_only = await generate(services, 0, {})
        for k in (1, 4, None):
            assert await generate(services, k, {}) == target_only
        seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
        first = await generate(services, 3, seeded)
        assert len(first) == 24 and await generate(services, 3, seeded) == first
    finally:
        await services.close()


def scripted_passes():
    """Passes of every shape the services make: prefills (longer than a graph), decodes and
    verifies at batch 1, 2, 3 and 5, sessions swapping rows, a batch too large for the rows, and
    rollbacks and releases in between. Yields (rows, then: "crop"/"release" session edits)."""
    yield [Row("a", PROMPTS[2] * 2, 1)], []
    yield [Row("b", PROMPTS[0], 1), Row("c", PROMPTS[1], 2)], []
    yield [Row("a", [5], 1)], []
    yield [Row("c", [6, 7, 8, 9, 10], 5), Row("a", [11], 1), Row("b", [12, 13], 2)], [("crop", "c", 7)]
    yield [Row(f"x{i}", PROMPTS[i % 3][: 3 + i], 1) for i in range(9)], [("release", "x3", 0)]  # 9 rows
    yield [Row("b", [14], 1), Row("x1", [15, 16, 17], 3), Row("a", [], 0), Row("x2", [18], 1), Row("c", [19], 1)], []
    yield [Row("x4", [20, 21], 2)], [("crop", "a", 3), ("release", "b", 0)]
    yield [Row("a", [22, 23, 24], 3), Row("b", [25], 1)], []


@pytest.mark.parametrize("device", DEVICES)
def test_static_slots_equal_dynamic_caches_pass_for_pass(tiny_on, device):
    """The same passes through the static slots (CUDA graphs on a GPU, eager on a CPU), eagerly
    over the same slots, and over DynamicCaches: the same logits, in float32."""
    loaded = tiny_on(device)["target"]
    slots, slots_eager, dynamic = (TransformersEngine(loaded, graphs=True) for _ in range(3))
    slots_eager.slots.graphs_enabled = False
    dynamic.slots = None
    for rows, edits in scripted_passes():
        outputs = [engine.forward(rows) for engine in (slots, slots_eager, dynamic)]
        for got, eager, reference in zip(*outputs):
            torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
        for edit, session_id, length in edits:
            for engine in (slots, slots_eager, dynamic):
                engine.crop(session_id, length) if edit == "crop" else engine.release(session_id)
    assert (slots.graphs >= 4) == (device == "cuda") and slots_eager.graphs == 0


class _OutOfMemoryOnce:
    """A hook before one decoder layer: the next pass that reaches it runs out of memory there."""

    def __init__(self, layer):
        self.handle = layer.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.handle.remove()
        raise torch.OutOfMemoryError("injected: out of memory in layer 1")


def test_running_out_of_device_memory_is_resource_exhausted_and_leaves_every_session_as_it_was(tiny_on, device, graphs):
    """The pass fails in the second layer, after the first took its new KV: the session gives it
    back, the other session never notices, and both go on exactly as a fresh run would."""
    loaded = tiny_on(device)["target"]
    # No prefix cache: with its copies in the memory that ran out, the store would give them back and
    # run the pass again (tests/test_prefix_cache.py), and this test is about the pass that fails.
    service = Verifier(TransformersEngine(loaded, graphs), Limits(prefix_cache_tokens=0))
    reference = Verifier(TransformersEngine(loaded, graphs), Limits(prefix_cache_tokens=0))
    for verifier in (service, reference):
        for index in (0, 1):
            verifier.prefill(Cursor(f"s{index}", 0, 0, PROMPTS[index]))
    cursor = Cursor("s0", len(PROMPTS[0]), fingerprint(PROMPTS[0]), [7])
    _OutOfMemoryOnce(loaded.model.model.layers[1])
    with pytest.raises(CapacityExceeded, match="ran out of memory"):
        service.verify(VerifyCall(cursor, [8, 9], [], Sampling()))
    assert len(service.store.sessions["s0"].tokens) == len(PROMPTS[0])
    for verifier in (service, reference):
        results = verifier.verify_batch(
            [
                VerifyCall(cursor, [8, 9], [], Sampling()),
                VerifyCall(Cursor("s1", len(PROMPTS[1]), fingerprint(PROMPTS[1]), [5]), [6], [], Sampling()),
            ]
        )
        if verifier is service:
            got = [(r.accepted, r.emitted_tokens, r.cached_tokens) for r in results]
        else:
            assert got == [(r.accepted, r.emitted_tokens, r.cached_tokens) for r in results]


# -- `specd serve` on a GPU ---------------------------------------------------------------------


@pytest.mark.gpu
@requires_gpu
async def test_specd_serve_target_on_a_gpu_reports_it_and_sizes_its_cache_from_device_memory(tiny_dirs, tmp_path):
    """A real `specd serve target --device cuda` process: Info says cuda:0, the GPU's name, its
    memory, bfloat16 by default, and a KV budget derived from free device memory; a GPU past the
    last one is one line and exit status 2."""
    missing = subprocess.run(
        [sys.executable, "-m", "specd.cli", "serve", "target", "--device", f"cuda:{torch.cuda.device_count()}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    port, log = free_port(), tmp_path / "target.log"
    command = [sys.executable, "-m", "specd.cli", "serve", "target", "--model", str(tiny_dirs["target"])]
    command += ["--device", "cuda", "--port", str(port), "--no-metrics"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        await wait_until_serving(f"127.0.0.1:{port}", timeout_s=180)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = await target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=10)
        assert (info.device, info.device_name, info.dtype) == ("cuda:0", torch.cuda.get_device_name(0), "bfloat16")
        assert 0 < info.device_memory_free_bytes <= info.device_memory_total_bytes
        per_token = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads, head dim 16, bfloat16
        assert Limits().max_cached_tokens < info.max_cached_tokens <= info.device_memory_free_bytes // per_token
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert process.returncode == 0, log.read_text()[-3000:]
