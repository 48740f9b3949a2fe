"""The load tester's figures from hand-built requests, and its workloads: no stack, no network
(bench/loadtest_stats.py, bench/workload.py, the report's comparison). Runs: tests/test_loadtest.py."""

import json
from collections import Counter
from pathlib import Path

import pytest

from specd.bench import loadtest
from specd.v1 import specdecode_pb2


def test_percentiles_interpolate_linearly_and_handle_no_values():
    stats = loadtest.percentiles([float(v) for v in range(1, 101)])
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)
    assert loadtest.percentiles([2.0]) == {"mean": 2.0, "p50": 2.0, "p90": 2.0, "p99": 2.0}
    assert loadtest.percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_inter_token_latency_splits_a_delta_over_its_tokens():
    # first delta at 1.0 (TTFT, not an ITL), then 3 tokens 0.3 s later, then 1 token 0.5 s later
    latencies = loadtest.inter_token_latencies([1.0, 1.3, 1.8], [1, 3, 1])
    assert latencies == pytest.approx([0.1, 0.1, 0.1, 0.5])
    assert loadtest.inter_token_latencies([1.0], [4]) == []


def test_request_result_ttft_tpot_e2e():
    result = loadtest.RequestResult(
        started=10.0, ended=11.0, delta_times=[10.2, 10.6, 11.0], delta_tokens=[1, 2, 2], completion_tokens=5
    )
    assert result.ttft == pytest.approx(0.2)
    assert result.e2e == pytest.approx(1.0)
    assert result.tpot == pytest.approx(0.8 / 4)
    assert (
        loadtest.RequestResult(started=0.0, ended=1.0, delta_times=[0.5], delta_tokens=[1], completion_tokens=1).tpot
        is None
    )


def test_speculation_summary_divides_by_the_steps_that_drafted_each_position():
    stats = [
        specdecode_pb2.SpeculationStats(
            draft_tokens=3, steps=4, drafted=12, accepted=6, accepted_per_position=[3, 2, 1], draft_lengths=[3, 3, 3, 3]
        ),
        # adaptive: K varied, and two steps ran target-only
        specdecode_pb2.SpeculationStats(
            draft_tokens=8,
            adaptive=True,
            steps=6,
            drafted=6,
            accepted=4,
            accepted_per_position=[3, 1],
            draft_lengths=[0, 1, 2, 3, 0, 0],
        ),
    ]
    summary = loadtest.speculation_summary(stats)
    assert summary["acceptance_rate"] == pytest.approx(10 / 18)
    assert summary["mean_accepted_length"] == pytest.approx(1 + 10 / 10)
    assert summary["acceptance_by_position"] == pytest.approx([6 / 7, 3 / 6, 1 / 5])
    assert summary["speculation_off_share"] == pytest.approx(3 / 10)
    assert summary["mean_draft_length"] == pytest.approx(18 / 7)
    off = loadtest.speculation_summary(
        [specdecode_pb2.SpeculationStats(draft_tokens=0, steps=8, draft_lengths=[0] * 8)]
    )
    assert off == {
        "acceptance_rate": None,
        "mean_accepted_length": 1.0,
        "acceptance_by_position": [],
        "speculation_off_share": 1.0,
        "mean_draft_length": None,
        "lookup_step_share": None,
        "lookup_acceptance_rate": None,
        "model_acceptance_rate": None,
    }


def test_source_summary_splits_the_drafting_steps_between_the_lookup_and_the_model():
    stats = [
        specdecode_pb2.SpeculationStats(
            drafter="hybrid",
            drafting_steps=4,
            drafted=14,
            accepted=9,
            lookup_steps=3,
            lookup_drafted=12,
            lookup_accepted=8,
        ),
        specdecode_pb2.SpeculationStats(drafter="model", drafting_steps=6, drafted=12, accepted=3),
    ]
    assert loadtest.source_summary(stats) == pytest.approx(
        {"lookup_step_share": 3 / 10, "lookup_acceptance_rate": 8 / 12, "model_acceptance_rate": 4 / 14}
    )
    only_lookup = [
        specdecode_pb2.SpeculationStats(
            drafting_steps=2, drafted=6, accepted=6, lookup_steps=2, lookup_drafted=6, lookup_accepted=6
        )
    ]
    assert loadtest.source_summary(only_lookup)["model_acceptance_rate"] is None


def test_calls_per_pass_is_the_mean_batch_of_the_passes_run_between_two_readings():
    before = {"draft": (Counter({1: 5}), 25), "target": (Counter({1: 5, 2: 1}), 9)}
    after = {"draft": (Counter({1: 5, 2: 4}), 65), "target": (Counter({1: 7, 2: 1, 4: 2}), 29)}
    assert loadtest.calls_per_pass(before, after) == {
        "draft_calls_per_pass": 2.0,
        "draft_tokens_per_pass": 10.0,
        "target_calls_per_pass": 2.5,
        "target_tokens_per_pass": 5.0,
    }
    nothing = dict.fromkeys(["draft_calls_per_pass", "draft_tokens_per_pass"], None)
    nothing |= dict.fromkeys(["target_calls_per_pass", "target_tokens_per_pass"], None)
    assert loadtest.calls_per_pass(after, after) == nothing
    assert loadtest.calls_per_pass(None, after) == nothing


def test_poisson_arrivals_are_seeded_and_average_the_rate():
    offsets = loadtest.arrival_offsets(rate=4.0, count=4000, seed=7)
    assert offsets == loadtest.arrival_offsets(rate=4.0, count=4000, seed=7)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(0.25, rel=0.1)


def test_compare_plan_runs_pairs_back_to_back_and_swaps_which_goes_first():
    assert loadtest.compare_plan([1, 2, 4]) == [
        (1, "speculative", 0),
        (1, "off", 0),
        (2, "off", 0),
        (2, "speculative", 0),
        (4, "speculative", 0),
        (4, "off", 0),
    ]
    # with repeats the order also swaps from one repeat to the next
    assert loadtest.compare_plan([1, 2], repeats=2) == [
        (1, "speculative", 0),
        (1, "off", 0),
        (1, "off", 1),
        (1, "speculative", 1),
        (2, "off", 0),
        (2, "speculative", 0),
        (2, "speculative", 1),
        (2, "off", 1),
    ]


def fake_run(mode: str, concurrency: int, tokens_per_s: float, ttft: float | None, k: float | None = None) -> dict:
    return {
        "mode": mode,
        "concurrency": concurrency,
        "output_tokens_per_s": tokens_per_s,
        "ttft_s": {"p50": ttft},
        "acceptance_rate": None if k is None else 0.5,
        "mean_draft_length": k,
        "speculation_off_share": 1.0 if mode == "off" else 0.25,
        "target_tokens_per_pass": 2.0,
    }


def test_comparison_takes_each_modes_median_run_and_divides():
    runs = [
        fake_run("speculative", 1, 30.0, 0.2, k=2.5),
        fake_run("off", 1, 20.0, 0.1),
        fake_run("off", 1, 10.0, 0.3),
        fake_run("speculative", 1, 60.0, 0.4, k=3.0),
        fake_run("speculative", 1, 40.0, 0.5, k=2.0),
        fake_run("off", 1, 25.0, 0.2),
        fake_run("speculative", 4, 50.0, 0.6, k=1.5),
        fake_run("off", 4, 0.0, None),  # every off request failed
        fake_run("speculative", 8, 70.0, 0.7, k=1.0),  # no off run at 8: no entry
    ]
    one, four = loadtest.comparison(runs)
    assert one["concurrency"] == 1 and four["concurrency"] == 4
    assert one["speculative"]["run"] == 4 and one["off"]["run"] == 1  # the medians: 40 of 30/60/40, 20 of 20/10/25
    assert one["speculative"]["output_tokens_per_s_all"] == [30.0, 60.0, 40.0]
    assert one["throughput_ratio"] == pytest.approx(40.0 / 20.0)
    assert one["ttft_p50_ratio"] == pytest.approx(0.5 / 0.1)
    assert one["speculative"]["mean_draft_length"] == 2.0 and one["speculative"]["speculation_off_share"] == 0.25
    assert one["off"]["mean_draft_length"] is None
    assert four["throughput_ratio"] is None and four["ttft_p50_ratio"] is None
    # an even count takes the lower middle run: a real run, not an average
    pair = [fake_run("speculative", 2, 9.0, 0.1, k=1.0), fake_run("speculative", 2, 5.0, 0.1, k=1.0)]
    assert loadtest.median_run(pair, [0, 1]) == 1


def test_machine_info_names_the_cpu_and_its_bf16_support():
    machine = loadtest.machine_info()
    assert isinstance(machine["cpu_model"], str) and machine["cpu_model"]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
        assert machine["avx512_bf16"] is ("avx512_bf16" in flags.split())
        assert machine["cpu_model"] in cpuinfo.read_text()


def test_long_workload_is_a_thousand_tokens_of_code_each():
    prompts = loadtest.load_prompts(loadtest.LONG_PROMPTS)
    assert len(prompts) >= 8 and len(set(prompts)) == len(prompts)
    for prompt in prompts:
        assert prompt.startswith("# Python standard library module")
        assert 2_000 <= len(prompt) <= 6_000  # about 1,000 Qwen tokens of Python (2-5 characters each)


def test_prose_workload_is_llmperf_style_sonnet_lines():
    prompts = loadtest.load_prompts(loadtest.PROSE_PROMPTS)
    assert 18 <= len(prompts) <= 24
    lines = [json.loads(line) for line in loadtest.PROSE_PROMPTS.read_text().splitlines()]
    assert {line["kind"] for line in lines} == {"prose"}
    for prompt in prompts:
        instruction, _, text = prompt.partition(":\n\n")
        assert instruction.endswith("Don't generate eos tokens")
        assert 90 <= len(prompt.split()) <= 140  # ≈ 150 tokens of verse
        assert len(text.splitlines()) >= 10
    assert len(set(prompts)) == len(prompts)


def test_prompts_file_ships_and_bad_files_say_why(tmp_path):
    prompts = loadtest.load_prompts()
    assert len(prompts) >= 20
    kinds = {json.loads(line)["kind"] for line in loadtest.DEFAULT_PROMPTS.read_text().splitlines()}
    assert kinds == {"code", "docstring", "prose", "chat"}
    with pytest.raises(loadtest.PromptsError, match="not found"):
        loadtest.load_prompts(tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(loadtest.PromptsError, match="broken.jsonl:2"):
        loadtest.load_prompts(broken)
