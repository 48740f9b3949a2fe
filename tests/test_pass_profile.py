"""What a pass costs, measured when a service loads (model/pass_profile.py): measured once per machine,
model and settings, then read from the cache; never failing a load; reported in Info; and the
orchestrator's first steps priced from it (orchestrator/costs.py ServiceCosts.seed)."""

import json
import re
import time

import grpc
import pytest
from conftest import TOKENIZER

from specd.deploy.roles import RoleConfig
from specd.deploy.services import model_server
from specd.model.engine import ModelDescription
from specd.model.errors import CapacityExceeded
from specd.model.pass_profile import PROFILE_POSITIONS, SIZES, cached_profiles, machine, pass_profile
from specd.orchestrator.adaptive import AdaptiveK
from specd.orchestrator.costs import PassCost, PassCurve, PassTime, ServiceCosts
from specd.proto.limits import Limits
from specd.v1 import common_pb2, target_pb2_grpc


class Timed:
    """An engine whose pass costs 2 ms and 1 ms a scored position; it counts its passes."""

    def __init__(self, name: str = "timed", fail: bool = False, widest: int = 1 << 20):
        self.description = ModelDescription(
            name=name,
            vocab_size=100,
            max_positions=4096,
            dtype="float32",
            device="cpu",
            eos_token_ids=[0],
            tokenizer_fingerprint="t",
        )
        self.fail, self.widest, self.passes, self.held = fail, widest, 0, {}

    def forward(self, rows):
        if self.fail or sum(row.keep_logits for row in rows) > self.widest:
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
    assert profile.positions == SIZES and len(seconds) == len(SIZES) and engine.passes > len(SIZES)
    assert seconds[PROFILE_POSITIONS - 1] > seconds[0] + 0.005  # 8 more positions at 1 ms each
    assert seconds[-1] > seconds[0] + 0.1  # 128 positions: 127 more
    assert 0 < profile.prefill_per_token < seconds[0] / 10  # one 3 ms pass over 128 tokens
    assert engine.held == {}  # its session released
    again = Timed()
    kept = pass_profile(again, {"threads": 2})
    assert kept.seconds == pytest.approx(seconds) and kept.prefill_per_token == profile.prefill_per_token
    assert kept.positions == SIZES
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
    assert len(pass_profile(engine).seconds) == len(SIZES) and engine.passes > 0


def test_an_engine_that_cannot_score_a_wide_pass_keeps_the_narrow_profile(tmp_path, monkeypatch):
    """A pass of 64 positions fails (an engine with a bound on one call): the profile stops at 32, and
    the narrow sizes the first steps are priced from are all there; one that fails a narrow size
    reports none."""
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    profile = pass_profile(Timed(widest=32))
    assert profile.positions == (*range(1, PROFILE_POSITIONS + 1), 16, 32) and len(profile.seconds) == 11
    assert pass_profile(Timed("narrow", widest=4)) is None


class Disturbed(Timed):
    """A Timed engine whose passes of 8 positions take 0.3 s more, the first `slow` times (the cores busy)."""

    def __init__(self, slow: int):
        super().__init__()
        self.slow = slow

    def forward(self, rows):
        if sum(row.keep_logits for row in rows) == 8 and self.slow > 0:
            self.slow -= 1
            time.sleep(0.3)
        return super().forward(rows)


def test_a_profile_measured_out_of_order_is_measured_again_and_never_kept(tmp_path, monkeypatch):
    """8 positions costing more than 16 (or 128) is the machine busy, not the engine: measured again;
    a profile that stays so is used for this load and not kept, so the next load measures anew."""
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    once = Disturbed(slow=3)  # all three of the first measurement's 8-position passes
    profile = pass_profile(once)
    assert once.slow == 0 and profile.seconds[7] < profile.seconds[9]  # the second measurement, in order
    assert len(list((tmp_path / "profiles").glob("passes-*.json"))) == 1  # ... kept
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "busy"))
    busy = Disturbed(slow=100)
    profile = pass_profile(busy)
    assert profile.seconds[7] > 0.3 > profile.seconds[9]  # used as measured, twice over
    assert busy.slow == 100 - 6 and not list((tmp_path / "busy" / "profiles").glob("passes-*.json"))


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
        assert len(info.pass_seconds) == len(SIZES) and tuple(info.pass_positions) == SIZES
        assert info.pass_seconds[0] == pytest.approx(0.0040 + 0.00016, rel=1e-5)
        assert info.pass_seconds[8] == pytest.approx(0.0040 + 9 * 0.00016, rel=1e-5)
        assert info.pass_seconds[-1] == pytest.approx(0.0040 + 128 * 0.00016, rel=1e-5)
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


# A CPU target's curve as the default target measured it under bitwise llama.cpp (2 cores, Zen 5):
# a decode 27 ms, 4 positions 87 ms, then about 11 ms a position as passes widen.
CPU_CURVE = dict(zip(SIZES, (0.027, 0.047, 0.067, 0.087, 0.1, 0.112, 0.124, 0.136, 0.148, 0.19, 0.37, 0.72, 1.41)))


def _curved(**told) -> ServiceCosts:
    """A worker's costs seeded from CPU_CURVE, wide passes and all (`told`: ServiceCosts fields)."""
    costs = ServiceCosts(**told)
    costs.seed([0.02] * PROFILE_POSITIONS, list(CPU_CURVE.values()), 0.001, list(CPU_CURVE))
    return costs


def _loaded(costs: ServiceCosts, streams: int) -> ServiceCosts:
    """`streams` streams' decode passes of 190 ms, and every fourth a narrower one that ran slow (5
    streams' rows while the draft caught up on a prompt beside it on the same cores)."""
    for i in range(12):
        calls, seconds = (streams, 0.19) if i % 4 else (5, 0.6)
        costs.record_target_pass(PassCost(calls, calls, seconds, streams), longest=9)
    costs.alpha.value = costs.lookup_alpha.value = 0.9
    return costs


def test_a_loaded_cpu_target_is_priced_on_its_curve_not_a_fit_that_loses_its_slope():
    """Passes all of one size with a few slow ones among them bend a fit of a + b·tokens flat (b = 0:
    verifying K = 8 looks free, as the default pair's 16 streams measured); the curve keeps the
    profile's shape, so at 16 streams speculation is off (the model's and the prompt lookup's, α 0.9)
    and at one stream the lookup's guesses still pay."""
    fit = ServiceCosts()
    fit.seed([0.02] * PROFILE_POSITIONS, list(CPU_CURVE.values())[:PROFILE_POSITIONS])
    _loaded(fit, 16)
    assert isinstance(fit.target_pass, PassTime) and fit.verify_seconds(8) < 1.5 * fit.verify_seconds(0)

    curve = _loaded(_curved(), 16)
    assert isinstance(curve.target_pass, PassCurve)
    along = (1.41 + (144 - 128) * (1.41 - 0.72) / 64) / 0.19  # 144 positions: past the curve's end, along its slope
    assert curve.verify_seconds(8) / curve.verify_seconds(0) == pytest.approx(along)
    chooser = AdaptiveK(curve, 8)
    chooser.on = True  # already speculating: no switch-on price, no margin
    assert chooser.next_k(40) == 0 and chooser.lookup_k(40, 8, model=True) == 0
    quiet = _curved()
    quiet.lookup_alpha.value = 0.9
    assert AdaptiveK(quiet, 8).lookup_k(40, 8, model=False) > 0


def test_the_curve_interpolates_extends_and_scales():
    curve = PassCurve([(1, 0.02), (9, 0.1), (16, 0.2)])
    assert curve.seconds(1) == pytest.approx(0.02) and curve.seconds(5) == pytest.approx(0.06)
    assert curve.seconds(30) == pytest.approx(0.2 + 14 * 0.1 / 7)  # along the last segment
    for _ in range(30):
        curve.add(9, 0.2)  # passes twice what the profile said: every size twice as dear
    assert curve.seconds(16) == pytest.approx(0.4, rel=1e-3) and curve.seconds(1) == pytest.approx(0.04, rel=1e-3)


@pytest.mark.parametrize(
    "splits, streams, lookup_on", [(True, 4, False), (False, 4, True), (True, 1, True), (True, 2, True)]
)
def test_a_target_that_splits_rows_prices_a_verify_as_a_part_of_its_own(splits, streams, lookup_on):
    """Where a verify among decode steps runs as a part of its own (llama.cpp, a KV stream per
    session), every stream waits for that part: at 4 streams a lookup with α 0.9 no longer pays
    (passes of 87 ms, a part of 8 guesses 136 ms), where the same curve without splits says it does;
    alone (nothing to split from) or at 2 streams with α 0.97 it pays."""
    costs = _curved(splits_rows=splits)
    costs.record_target_pass(PassCost(streams, streams, CPU_CURVE[streams], streams), longest=9)
    costs.lookup_alpha.value = 0.9 if streams == 4 else 0.97
    chooser = AdaptiveK(costs, 8)
    assert (chooser.lookup_k(40, 8, model=False) > 0) is lookup_on
    if splits and streams > 1:
        assert costs.verify_seconds(8) == pytest.approx(CPU_CURVE[streams] + streams * CPU_CURVE[8])


def test_models_list_shows_what_a_loaded_pass_costs(tmp_path, monkeypatch, capsys):
    """`specd models list`: each profile's 1 / 4 / 9 scored positions and its 16 / 128-position passes."""
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    pass_profile(Timed())
    from specd.cli.models import _print_profiles

    _print_profiles()
    row = next(line for line in capsys.readouterr().out.splitlines() if "timed" in line)
    widths = [int(ms) for ms in re.findall(r"(\d+) / (\d+)\s*│?\s*$", row.rstrip(" │"))[0]]
    assert 16 <= widths[0] < widths[1] and widths[1] >= 128  # 2 ms and 1 ms a position: 18 and 130
