"""The peer benchmark's figures and report (bench/figures.py, bench/report.py) on hand-built runs,
no stack: the expected speed-up and analytic best, the first difference, the report's figures and
tables, the faster HF peer per prompt, an older report still rendering."""

import io
import json
import subprocess
import sys

import pytest
from test_bench import PNG_SIGNATURE

from specd.bench import report as bench_report
from specd.bench import systems
from specd.deploy.roles import RoleConfig


def spec(steps, drafted, accepted, per_position, draft_s, verify_s):
    """specd's final stats for one request, each step alike."""
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "accepted_per_position": per_position,
        "draft_seconds": draft_s,
        "verify_seconds": verify_s,
        "other_seconds": 0.0,
        "draft_lengths": [drafted // steps] * steps,
        "step_draft_seconds": [draft_s / steps] * steps,
        "step_verify_seconds": [verify_s / steps] * steps,
    }


def test_the_report_and_the_runner_import_without_torch_or_grpc():
    """The figures are bookkeeping: a machine without torch can rebuild and plot a report."""
    heavy = ("torch", "transformers", "grpc", "specd.model")
    script = (
        "import json, sys; import specd.bench.report, specd.bench.systems; "
        f"print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []


def test_expected_speedup_and_analytic_best_on_hand_numbers():
    # α = 0.8, c = 0.1: K = 4 gives (1 - 0.8^5) / (0.2 · 1.4) = 0.67232 / 0.28
    assert bench_report.expected_speedup(0.8, 0.1, 4) == pytest.approx(0.67232 / 0.28)
    # best over K = 1..8: K = 6, (1 - 0.8^7) / (0.2 · 1.6) = 0.7902848 / 0.32 ≈ 2.4696
    best, k = bench_report.analytic_best(0.8, 0.1)
    assert k == 6 and best == pytest.approx(0.7902848 / 0.32)
    # docs/architecture.md §7's pair: α ≈ 0.9, c ≈ 0.4 gives about 1.6× at K = 4
    best, k = bench_report.analytic_best(0.9, 0.4)
    assert (k, round(best, 2)) == (4, 1.58)
    # α = 1: every guess lands, K + 1 tokens per step; α = 0: one token per step, so K = 1 is best
    assert bench_report.expected_speedup(1.0, 0.5, 3) == pytest.approx(4 / 2.5)
    assert bench_report.analytic_best(0.0, 0.2) == (pytest.approx(1 / 1.2), 1)
    assert bench_report.analytic_best(None, 0.2) == (None, None)
    assert bench_report.analytic_best(0.5, None) == (None, None)


def test_first_difference():
    assert bench_report.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench_report.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench_report.first_difference([1, 2], [1, 2, 3]) == 2


def test_report_figures_from_hand_built_runs():
    ids = [1, 2, 3, 4]
    runs = {
        "hf_target": [systems.Run(ids, 2.0), systems.Run(ids, 2.0)],
        "hf_assisted": [systems.Run(ids, 1.0), systems.Run([1, 2, 9, 4], 1.0)],
        "hf_lookup": [systems.Run(ids, 2.0), systems.Run(ids, 2.0)],
        "specd_target": [
            systems.Run(ids, 2.5, spec(4, 0, 0, [], 0.0, 2.0)),
            systems.Run(ids, 2.5, spec(4, 0, 0, [], 0.0, 4.0)),
        ],  # 0.5 and 1.0 s per step
        "specd_spec": [
            systems.Run(ids, 1.0, spec(2, 4, 2, [2], 0.4, 0.5)),  # 0.1 s per drafted token
            systems.Run(ids, 1.0, spec(1, 2, 2, [1, 1], 0.6, 0.5)),
        ],  # 0.3 s per drafted token
    }
    settings = systems.BenchSettings(
        prompts=["a", "b"],
        kinds=["code", "prose"],
        max_new_tokens=4,
        draft_tokens=2,
        draft=RoleConfig("draft", engine="llama.cpp"),
    )
    report = bench_report.build_report(settings, runs, [[7], [8, 9]])
    assert report["settings"]["engine"] == {"draft": "llama.cpp", "target": None}  # None: the service's default
    assert report["results"]["hf_target"] == {"tokens": 8, "seconds": 4.0, "tokens_per_s": 2.0}
    assert report["results"]["specd_spec"]["tokens_per_s"] == 4.0
    assert report["ratios"]["specd_spec/hf_target"] == 2.0
    assert report["ratios"]["specd_spec/specd_target"] == pytest.approx(4.0 / 1.6)
    assert report["alpha"] == pytest.approx(4 / 6)
    assert report["mean_accepted_length"] == pytest.approx(1 + 4 / 3)
    assert report["c"] == pytest.approx(0.2 / 0.75)  # median 0.2 s per draft token / median 0.75 s per step
    # position 2 was drafted in all 3 steps (K = 2 each) and accepted once
    assert report["acceptance_by_position"] == pytest.approx([3 / 3, 1 / 3])
    assert report["per_prompt"][0]["draft_lengths"] == [2, 2] and report["speculation_off_share"] == 0.0
    assert report["per_prompt"][0]["c"] == pytest.approx(0.1 / 0.5)
    assert report["median_ratios"]["specd_spec/hf_assisted"] == pytest.approx(1.0)  # 4/4 and 4/4 tokens/s
    assert report["speedup_of_analytic_best"] == pytest.approx((4.0 / 1.6) / report["analytic_speedup"])
    # per step: decode 0.5 / 1.0 s (median 0.75), drafts 0.1, 0.1, 0.3 s per token, Verify(K=2) 0.25, 0.25, 0.5 s
    assert report["measured_costs"] == {
        "target_step_s": 0.75,
        "draft_token_s": pytest.approx(0.1),
        "verify_s_by_k": {2: 0.25},
    }
    tokens = 1 + 2 / 3 + (2 / 3) ** 2  # E[tokens](K = 2) at α = 2/3
    assert report["achievable_speedup"] == pytest.approx(tokens * 0.75 / (2 * 0.1 + 0.25))
    assert report["achievable_best_k"] == 2
    assert report["greedy_match"] is True and report["hf_assisted_match"] is False
    assert report["hf_lookup_match"] is True  # each HF peer against hf_target on its own
    assert report["per_prompt"][1]["first_difference"]["hf_assisted"] == 2
    assert report["per_prompt"][1]["prompt_tokens"] == 2 and report["per_prompt"][1]["kind"] == "prose"
    assert report["settings"]["lookup_tokens"] == systems.LOOKUP_TOKENS == 10


def test_hf_best_is_the_faster_hf_peer_on_each_prompt():
    """specd_spec/hf_best: over all tokens against the faster HF total; per prompt (and so its median)
    against whichever of hf_assisted and hf_lookup was faster on that prompt."""
    ids = [1, 2, 3, 4]
    runs = {
        "hf_target": [systems.Run(ids, 2.0), systems.Run(ids, 2.0), systems.Run(ids, 2.0)],  # 2 tokens/s
        "hf_assisted": [systems.Run(ids, 1.0), systems.Run(ids, 1.0), systems.Run(ids, 1.0)],  # 4, 4, 4
        "hf_lookup": [
            systems.Run(ids, 0.25),  # 16 tokens/s: the edit prompt, lookup wins
            systems.Run([1, 2, 3, 7], 2.0),  # 2: nothing to copy, assisted wins
            systems.Run(ids, 0.5),  # 8: lookup wins
        ],
        "specd_target": [systems.Run(ids, 2.0, spec(4, 0, 0, [], 0.0, 2.0)) for _ in range(3)],
        "specd_spec": [systems.Run(ids, 0.5, spec(2, 4, 2, [2], 0.2, 0.3)) for _ in range(3)],  # 8 tokens/s
    }
    settings = systems.BenchSettings(prompts=["a", "b", "c"], kinds=["edit"] * 3, max_new_tokens=4, lookup_tokens=6)
    report = bench_report.build_report(settings, runs, [[7], [8], [9]])

    lookup = 12 / 2.75  # tokens/s over all prompts
    assert report["results"]["hf_lookup"] == {"tokens": 12, "seconds": 2.75, "tokens_per_s": pytest.approx(lookup)}
    assert report["ratios"]["specd_spec/hf_lookup"] == pytest.approx(8 / lookup)
    assert report["ratios"]["hf_lookup/hf_target"] == pytest.approx(lookup / 2)
    assert report["ratios"]["specd_spec/hf_best"] == pytest.approx(8 / lookup)  # lookup's total beats assisted's 4
    assert [entry["hf_best"] for entry in report["per_prompt"]] == ["hf_lookup", "hf_assisted", "hf_lookup"]
    per_prompt = [entry["ratios"]["specd_spec/hf_best"] for entry in report["per_prompt"]]
    assert per_prompt == pytest.approx([8 / 16, 8 / 4, 8 / 8])
    assert report["median_ratios"]["specd_spec/hf_best"] == pytest.approx(1.0)
    assert report["median_ratios"]["specd_spec/hf_lookup"] == pytest.approx(1.0)  # 0.5, 4, 1
    assert report["median_ratios"]["hf_lookup/hf_target"] == pytest.approx(4.0)  # 8, 1, 4
    assert report["median_ratios"]["specd_spec/hf_assisted"] == pytest.approx(2.0)  # the old keys stay
    assert report["hf_lookup_match"] is False and report["hf_assisted_match"] is True
    assert report["per_prompt"][1]["matches_hf_target"]["hf_lookup"] is False
    assert report["per_prompt"][1]["first_difference"]["hf_lookup"] == 3
    assert report["settings"]["lookup_tokens"] == 6

    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    for table in bench_report.summary_tables(report):
        console.print(table)
    text = console.file.getvalue()
    assert "specd_spec / hf_best" in text and "hf_lookup == hf_target" in text and "hf_lookup" in text


def test_a_report_from_before_hf_lookup_still_renders(tmp_path):
    """Reports written with four systems (docs/results/) still print and plot."""
    from pathlib import Path

    from rich.console import Console

    old = json.loads((Path(__file__).parent.parent / "docs" / "results" / "bench_adaptive.json").read_text())
    assert "hf_lookup" not in old["results"]
    console = Console(file=io.StringIO(), width=200)
    for table in bench_report.summary_tables(old):
        console.print(table)
    assert "specd_spec / hf_assisted" in console.file.getvalue()
    bench_report.save_plot(old, tmp_path / "old.png")
    assert (tmp_path / "old.png").read_bytes().startswith(PNG_SIGNATURE)
