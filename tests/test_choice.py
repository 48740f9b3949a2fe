"""The configuration `specd bench --configurations` measured fastest here (deploy/choice.py): kept per
machine and pair, the default of a stack here whose flags leave engine and drafter to specd, and
never over a flag given by hand."""

import argparse

from test_bench_configurations import _runs

from specd.bench.configurations import Configuration, _report
from specd.bench.systems import BenchSettings
from specd.cli.common import measured_choice
from specd.deploy import choice
from specd.deploy.roles import RoleConfig

SAME = [[1, 2], [3, 4]]


def _measured() -> dict:
    group = [
        Configuration("llama.cpp", "hybrid", True, _runs([1.0, 1.0], SAME)),  # 2 tok/s: the rule's default
        Configuration("llama.cpp", "target-only", True, _runs([0.2, 0.2], SAME)),  # a reference row, not a choice
        Configuration("llama.cpp", "suffix", False, _runs([0.5, 0.5], SAME)),  # 4 tok/s
        Configuration("transformers", "model", True, _runs([0.8, 0.8], SAME)),
    ]
    return _report(BenchSettings(prompts=["a", "b"]), ["llama.cpp", "transformers"], group, {})


def _args(**given) -> argparse.Namespace:
    flags = {"engine": "auto", "draft_engine": "auto", "device": "auto", "draft_device": "auto", **given}
    return argparse.Namespace(**flags)


def test_the_fastest_configuration_that_chooses_k_is_kept_per_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECD_CHOICE")  # conftest's: off for every other test's stacks
    assert choice.load("draft", "target") is None
    kept = choice.save(_measured(), "draft", "target")
    assert (kept.engine, kept.drafter) == ("llama.cpp", "suffix")  # not the faster target-only reference
    assert kept.tokens_per_s == 4.0 and kept.default_tokens_per_s == 2.0
    assert choice.load("draft", "target") == kept and "2.00× the rule's" in kept.describe()
    assert choice.load("draft", "other-target") is None
    monkeypatch.setenv("SPECD_CHOICE", "off")
    assert choice.load("draft", "target") is None
    monkeypatch.delenv("SPECD_CHOICE")
    assert choice.forget("draft", "target") and choice.load("draft", "target") is None


def test_a_stack_here_runs_it_where_the_flags_leave_it_to_specd(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECD_CHOICE")
    roles = {"draft": RoleConfig("draft"), "target": RoleConfig("target", engine="auto")}
    assert measured_choice(_args(), roles, None) == (roles, None)  # nothing measured: the rule
    choice.save(_measured(), "draft", "target")
    chosen, drafter = measured_choice(_args(), roles, None)
    assert drafter == "suffix" and {config.engine for config in chosen.values()} == {"llama.cpp"}
    assert "configuration: --engine llama.cpp --drafter suffix" in capsys.readouterr().err
    for given, drafter in ((_args(engine="transformers"), None), (_args(device="cpu"), None), (_args(), "model")):
        assert measured_choice(given, roles, drafter) == (roles, drafter)
