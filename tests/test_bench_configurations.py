"""`specd bench --configurations` (bench/configurations.py): every engine × drafter side by side, the
fastest named and the default's ratio to it; end to end over simulated engines (two local stacks)."""

import pytest
from conftest import TOKENIZER

from specd.bench.configurations import DEFAULT, Configuration, _report, run_configurations, summary_rows
from specd.bench.systems import BenchSettings, Run
from specd.cli.bench import _engines
from specd.cli.common import UserError
from specd.deploy.roles import RoleConfig


def _runs(seconds: list[float], tokens: list[list[int]]) -> list[Run]:
    return [
        Run(ids, s, {"drafted": 4, "accepted": 3, "steps": 2, "draft_lengths": [4, 0]})
        for s, ids in zip(seconds, tokens)
    ]


def test_the_report_names_the_fastest_and_the_defaults_ratio_and_checks_the_text():
    same, other = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    group = [
        Configuration("llama.cpp", "hybrid", True, _runs([1.0, 1.0], same)),  # 2 tok/s
        Configuration("llama.cpp", "model", True, _runs([2.0, 2.0], other)),  # 1 tok/s, its text differs
        Configuration("llama.cpp", "target-only", True, _runs([0.5, 1.5], same)),  # 2 tok/s
        Configuration("llama.cpp", "suffix", False, _runs([0.4, 0.4], same)),  # 5 tok/s
        Configuration("llama.cpp", "target-only", False, _runs([0.8, 0.8], same)),
    ]
    report = _report(BenchSettings(prompts=["a", "b"]), ["llama.cpp"], group, {})
    assert report["fastest"] == "llama.cpp suffix" and report["default"] == DEFAULT == "llama.cpp hybrid"
    assert report["default_vs_fastest"] == pytest.approx(2.0 / 5.0)
    results = report["results"]
    assert results["llama.cpp model"]["same_text_as_target_only"] is False
    assert results["llama.cpp hybrid"]["same_text_as_target_only"] is True
    assert results["llama.cpp hybrid"]["alpha"] == pytest.approx(0.75) and results["llama.cpp hybrid"]["steps_off"] == 2
    assert "llama.cpp target-only (no draft)" in results
    rows = summary_rows(report)
    assert rows[0][0] == "llama.cpp suffix" and rows[0][2] == "1.00×"
    assert any(row[0] == "llama.cpp hybrid  (default)" and row[2] == "0.40×" for row in rows)


def test_engines_are_checked():
    assert _engines("llama.cpp, transformers") == ["llama.cpp", "transformers"]
    assert _engines(None)[0] == "llama.cpp"
    for bad in ("", "vllm", "llama.cpp,sim"):
        with pytest.raises(UserError, match="--engines"):
            _engines(bad)


async def test_every_configuration_runs_over_simulated_engines_and_keeps_the_target_only_text():
    """Two stacks (with a draft service, without), three configurations each; greedy output is the
    target's in every one (the simulated target's token is a function of the context)."""
    model = TOKENIZER or ""
    settings = BenchSettings(
        prompts=["def add(a, b):\n", "import os\n"],
        max_new_tokens=12,
        draft=RoleConfig(model or "draft", port=0, metrics_port=None),
        target=RoleConfig(model or "target", port=0, metrics_port=None),
        timeout=120,
    )
    report = await run_configurations(settings, ["sim:profile=gpu,scale=0.2"], say=lambda message: None)
    results = report["results"]
    assert len(results) == 6 and report["default"] is None  # the default engine was not among those run
    assert all(result["tokens"] == 24 and result["same_text_as_target_only"] for result in results.values())
    with_draft = {name for name, result in results.items() if result["draft_service"]}
    assert with_draft == {f"sim:profile=gpu,scale=0.2 {drafter}" for drafter in ("hybrid", "model", "target-only")}
    assert all(len(result["per_prompt_tokens_per_s"]) == 2 and result["steps"] > 0 for result in results.values())
    assert report["fastest"] in results and report["environment"]["cpu"]
