"""What a pass costs, measured when a service loads (model/pass_profile.py): measured once per machine,
model and settings, then read from the cache; never failing a load; reported in Info; and the
orchestrator's first steps priced from it (orchestrator/costs.py ServiceCosts.seed)."""

import json
import time

import grpc
import pytest
from conftest import TOKENIZER

from specd.deploy.roles import RoleConfig
from specd.deploy.services import model_server
from specd.model.engine import ModelDescription
from specd.model.errors import CapacityExceeded
from specd.model.pass_profile import PROFILE_POSITIONS, cached_profiles, machine, pass_profile
from specd.orchestrator.adaptive import AdaptiveK
from specd.orchestrator.costs import ServiceCosts
from specd.proto.limits import Limits
from specd.v1 import common_pb2, target_pb2_grpc


class Timed:
    """An engine whose pass costs 2 ms and 1 ms a scored position; it counts its passes."""

    def __init__(self, name: str = "timed", fail: bool = False):
        self.description = ModelDescription(
            name=name,
            vocab_size=100,
            max_positions=4096,
            dtype="float32",
            device="cpu",
            eos_token_ids=[0],
            tokenizer_fingerprint="t",
        )
        self.fail, self.passes, self.held = fail, 0, {}

    def forward(self, rows):
        if self.fail:
            raise CapacityExceeded("no room")
        self.passes += 1
        for row in rows:
            self.held[row.session_id] = self.held.get(row.session_id, 0) + len(row.tokens)
        time.sleep(0.002 + 0.001 * sum(row.keep_logits for row in rows))
        return [None for _ in rows]

    def crop(self, session_id, length):
        self.held[session_id] = min(self.held.get(session_id, 0), length)

    def release(self, session_id):
        self.held.pop(session_id, None)


def test_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    engine = Timed()
    profile = pass_profile(engine, {"threads": 2})
    seconds = profile.seconds
    assert len(seconds) == PROFILE_POSITIONS and engine.passes > PROFILE_POSITIONS
    assert seconds[-1] > seconds[0] + 0.005  # 8 more positions at 1 ms each
    assert 0 < profile.prefill_per_token < seconds[0] / 10  # one 3 ms pass over 128 tokens
    assert engine.held == {}  # its session released
    again = Timed()
    kept = pass_profile(again, {"threads": 2})
    assert kept.seconds == pytest.approx(seconds) and kept.prefill_per_token == profile.prefill_per_token
    assert again.passes == 0
    other = Timed()  # other settings (or another model, machine): measured anew
    pass_profile(other, {"threads": 1})
    assert other.passes > 0
    kept_choice = tmp_path / "profiles" / "choice-0123.json"  # deploy/choice.py's, in the same folder
    kept_choice.write_text(json.dumps({"format": 1, "key": {"machine": machine()}, "choice": {}}))
    profiles = cached_profiles()
    assert len(profiles) == 2 and all(profile["key"]["machine"] == machine() for profile in profiles)
    assert kept_choice.exists()
    assert {profile["key"]["settings"]["threads"] for profile in profiles} == {1, 2}


def test_a_stale_or_broken_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    pass_profile(Timed())
    (path,) = (tmp_path / "profiles").glob("passes-*.json")
    profile = json.loads(path.read_text())
    path.write_text(json.dumps({**profile, "key": {**profile["key"], "machine": {"cpu": "another"}}}))
    engine = Timed()
    pass_profile(engine)
    assert engine.passes > 0
    path.write_text("{not json")
    engine = Timed()
    assert len(pass_profile(engine).seconds) == PROFILE_POSITIONS and engine.passes > 0


def test_a_measurement_that_fails_reports_none_and_fails_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    assert pass_profile(Timed(fail=True)) is None
    assert not (tmp_path / "profiles").exists() or not list((tmp_path / "profiles").iterdir())


async def test_a_served_target_reports_its_passes_in_info():
    """Through model_server, as `specd serve target` builds it: the simulated engine reports what its
    profile prices (1, 2, ... positions: 4 ms a pass and 0.16 ms a position on the GPU profile), and
    measures nothing (nothing written to the cache)."""
    settings = RoleConfig(model=TOKENIZER or "target", engine="sim:profile=gpu")
    server = model_server("target", settings, None, Limits())
    await server.start("127.0.0.1:0")
    await server.load()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            info = await target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.InfoRequest())
        assert len(info.pass_seconds) == PROFILE_POSITIONS
        assert info.pass_seconds[0] == pytest.approx(0.0040 + 0.00016, rel=1e-5)
        assert info.pass_seconds[8] == pytest.approx(0.0040 + 9 * 0.00016, rel=1e-5)
        assert info.prefill_seconds_per_token == pytest.approx(0.00016, rel=1e-4)
    finally:
        await server.stop(0)


def _costs(target: list[float], draft: float = 0.01) -> ServiceCosts:
    costs = ServiceCosts()
    costs.seed([draft] * PROFILE_POSITIONS, target, draft_prefill=0.001)
    return costs


def test_a_fresh_worker_prices_its_first_step_from_the_profile():
    """Where verifying K + 1 positions costs K + 1 decode steps (llama.cpp's exact kernels on a small
    CPU) the first step is already target-only; where it rides almost free (a GPU), it speculates;
    without a profile a fresh worker still explores (a decode first)."""
    linear = _costs([0.03 * n for n in range(1, PROFILE_POSITIONS + 1)])
    assert linear.ready() and linear.verify_seconds(3) == pytest.approx(0.12)
    assert linear.catchup_seconds(100) == pytest.approx(0.1)  # at the prefill's cost, not a guess's 0.01 a token
    assert AdaptiveK(linear, 8).next_k(64) == 0
    flat = _costs([0.03 + 0.001 * n for n in range(1, PROFILE_POSITIONS + 1)])
    assert AdaptiveK(flat, 8).next_k(64) > 0
    assert not ServiceCosts().ready() and AdaptiveK(ServiceCosts(), 8).next_k(64) == 0
