"""The load-testing harness: short runs on the tiny stack, and OpenAI-compatible targets (its figures
on hand-built numbers: tests/test_loadtest_stats.py)."""

import argparse
import asyncio
import itertools
import json
import os
import socket

import pytest

from specd.bench import loadtest, loadtest_report, openai_client
from specd.cli import loadtest as loadtest_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
QUANTILES = ("mean", "p50", "p90", "p99")
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
RUN_KEYS = {
    "concurrency",
    "rate",
    "requests",
    "output_tokens_per_s",
    "requests_per_s",
    *LATENCIES,
    "acceptance_rate",
    "mean_accepted_length",
    "acceptance_by_position",
    "errors",
}


def settings_for(address: str, **overrides) -> loadtest.Settings:
    values = dict(server=address, prompts=loadtest.load_prompts(), max_new_tokens=8, draft_tokens=3, timeout=60.0)
    return loadtest.Settings(**{**values, **overrides})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------- runs on the tiny stack


def check_run(run: dict, requests: int, max_new_tokens: int) -> None:
    assert RUN_KEYS <= set(run)
    assert run["errors"] == {} and run["completed"] == requests == run["requests"]
    assert run["output_tokens"] == requests * max_new_tokens  # ignore_eos: every request yields them all
    assert run["output_tokens_per_s"] * run["wall_s"] == pytest.approx(run["output_tokens"])
    assert run["requests_per_s"] * run["wall_s"] == pytest.approx(requests)
    for key in LATENCIES:
        stats = run[key]
        assert set(stats) == set(QUANTILES)
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert run["ttft_s"]["p50"] <= run["e2e_s"]["p50"]
    assert 0 <= run["acceptance_rate"] <= 1 and 1 <= run["mean_accepted_length"] <= 4
    assert 1 <= len(run["acceptance_by_position"]) <= 3
    assert all(0 <= rate <= 1 for rate in run["acceptance_by_position"])


async def test_closed_loop_sweep_and_open_loop_run(tiny_stack, tmp_path):
    # the draft model guesses every step (a lookup could guess them all: the shared stack indexes its outputs)
    settings = settings_for(f"127.0.0.1:{tiny_stack.orchestrator.port}", drafter="model")
    report = await loadtest.run_loadtest(settings, requests=6, concurrency=[1, 2], rates=[20.0])
    report = json.loads(json.dumps(report))  # the report is plain JSON
    assert [(r["concurrency"], r["rate"]) for r in report["runs"]] == [(1, None), (2, None), (None, 20.0)]
    for run in report["runs"]:
        check_run(run, requests=6, max_new_tokens=8)
    assert report["settings"]["max_new_tokens"] == 8 and report["settings"]["ignore_eos"] is True
    assert report["settings"]["server_info"]["workers"] == 2
    one, two = report["runs"][0], report["runs"][1]
    assert one["target_calls_per_pass"] == 1.0  # one stream: nothing to batch with
    assert 1.0 <= two["target_calls_per_pass"] <= 2.0 and 1.0 <= two["draft_calls_per_pass"] <= 2.0
    assert two["target_tokens_per_pass"] >= two["target_calls_per_pass"]  # a call adds >= 1 new token
    loadtest_report.save_plot(report, tmp_path / "loadtest.png")
    assert (tmp_path / "loadtest.png").read_bytes().startswith(PNG_SIGNATURE)
    assert loadtest_report.summary_table(report).row_count == 3


async def test_speculation_off_reports_no_acceptance(tiny_stack):
    settings = settings_for(f"127.0.0.1:{tiny_stack.orchestrator.port}", draft_tokens=0)
    (run,) = (await loadtest.run_loadtest(settings, requests=2, concurrency=[2]))["runs"]
    assert run["errors"] == {} and run["acceptance_rate"] is None and run["acceptance_by_position"] == []
    assert run["mean_accepted_length"] == 1.0


async def test_the_drafter_reaches_every_request_and_the_report_splits_by_source(tiny_stack):
    address = f"127.0.0.1:{tiny_stack.orchestrator.port}"
    (model,) = (await loadtest.run_loadtest(settings_for(address, drafter="model"), requests=2, concurrency=[2]))[
        "runs"
    ]
    assert model["errors"] == {} and model["lookup_step_share"] == 0.0 and model["model_acceptance_rate"] is not None
    report = await loadtest.run_loadtest(settings_for(address, drafter="ngram"), requests=2, concurrency=[2])
    assert report["settings"]["drafter"] == "ngram"
    assert report["runs"][0]["model_acceptance_rate"] is None  # ngram never asks the draft model


async def test_compare_mode_measures_both_modes_per_concurrency(tiny_stack, tmp_path):
    settings = settings_for(f"127.0.0.1:{tiny_stack.orchestrator.port}")
    report = await loadtest.run_loadtest(settings, requests=3, concurrency=[1, 2], compare=True, repeats=2)
    report = json.loads(json.dumps(report))  # the report is plain JSON
    runs = report["runs"]
    assert [(r["concurrency"], r["mode"], r["repeat"]) for r in runs] == loadtest.compare_plan([1, 2], 2)
    for run in runs:
        assert run["errors"] == {} and run["output_tokens"] == 3 * 8
        if run["mode"] == "off":  # K = 0: nothing drafted
            assert run["acceptance_rate"] is None and run["mean_draft_length"] is None
            assert run["acceptance_by_position"] == [] and run["speculation_off_share"] == 1.0
        else:
            check_run(run, requests=3, max_new_tokens=8)
            assert 0 < run["mean_draft_length"] <= 3 and run["speculation_off_share"] < 1.0
    assert [entry["concurrency"] for entry in report["comparison"]] == [1, 2]
    for entry in report["comparison"]:
        spec, off = runs[entry["speculative"]["run"]], runs[entry["off"]["run"]]
        assert (spec["mode"], off["mode"]) == ("speculative", "off")
        assert spec["concurrency"] == off["concurrency"] == entry["concurrency"]
        assert entry["throughput_ratio"] == pytest.approx(spec["output_tokens_per_s"] / off["output_tokens_per_s"])
        assert entry["ttft_p50_ratio"] == pytest.approx(spec["ttft_s"]["p50"] / off["ttft_s"]["p50"])
        assert entry["speculative"]["output_tokens_per_s"] == min(entry["speculative"]["output_tokens_per_s_all"])
        assert len(entry["off"]["output_tokens_per_s_all"]) == 2
        assert entry["speculative"]["mean_draft_length"] == spec["mean_draft_length"] > 0
        assert entry["speculative"]["target_tokens_per_pass"] == spec["target_tokens_per_pass"] >= 1
        assert entry["off"]["mean_draft_length"] is None
    assert report["settings"]["compare"] is True and report["settings"]["repeats"] == 2
    assert report["settings"]["machine"]["cpu_model"]
    loadtest_report.save_plot(report, tmp_path / "compare.png")
    png = (tmp_path / "compare.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    assert loadtest_report.comparison_table(report).row_count == 2
    assert loadtest_report.summary_table(report).row_count == 8


async def test_compare_mode_refuses_open_loop_and_speculation_off():
    for overrides, rates in (({}, [2.0]), ({"draft_tokens": 0}, [])):
        with pytest.raises(ValueError, match="compare"):
            await loadtest.run_loadtest(
                settings_for("127.0.0.1:1", **overrides), requests=1, concurrency=[1], rates=rates, compare=True
            )


async def test_unreachable_server_counts_unavailable_instead_of_crashing(tmp_path):
    settings = settings_for(f"127.0.0.1:{free_port()}", timeout=10.0)
    report = await loadtest.run_loadtest(settings, requests=3, concurrency=[2], rates=[50.0])
    for run in report["runs"]:
        assert run["errors"] == {"UNAVAILABLE": 3}
        assert run["completed"] == 0 and run["output_tokens_per_s"] == 0.0
        assert run["ttft_s"]["p50"] is None
    assert report["settings"]["server_info"] is None
    loadtest_report.save_plot(report, tmp_path / "empty.png")  # a report with no successes still plots
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_SIGNATURE)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specd")
    loadtest_cli.add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def sweep_argv(stack, requests: int, *extra: str) -> list[str]:
    """`specd loadtest` over concurrency 1,2 with K = 2 and 6 tokens per request against the stack."""
    server = f"127.0.0.1:{stack.orchestrator.port}"
    return ["loadtest", "--server", server, "--concurrency", "1,2", "--requests", str(requests),
            "--max-new-tokens", "6", "--draft-tokens", "2", *extra]  # fmt: skip


async def test_command_line_writes_json_and_plot(tiny_stack, tmp_path):
    argv = sweep_argv(tiny_stack, 3, "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png"))
    # the command runs its own event loop (asyncio.run): keep it off the loop serving the tiny stack
    assert await asyncio.to_thread(cli, argv) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert [run["concurrency"] for run in report["runs"]] == [1, 2]
    assert all(run["output_tokens"] == 18 for run in report["runs"])
    assert (tmp_path / "out.png").read_bytes().startswith(PNG_SIGNATURE)


async def test_command_line_rejects_a_missing_prompts_file(tmp_path):
    from specd.cli.common import UserError

    with pytest.raises(UserError, match="not found"):
        cli(["loadtest", "--server", "127.0.0.1:1", "--prompts", str(tmp_path / "nope.jsonl")])


async def test_command_line_compare_writes_both_modes_and_their_plot(tiny_stack, tmp_path):
    argv = sweep_argv(
        tiny_stack, 2, "--compare", "--prompts", str(loadtest.PROSE_PROMPTS),
        "--json", str(tmp_path / "compare.json"), "--plot", str(tmp_path / "compare.png"),
    )  # fmt: skip
    assert await asyncio.to_thread(cli, argv) == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    assert [(run["concurrency"], run["mode"]) for run in report["runs"]] == [
        (1, "speculative"),
        (1, "off"),
        (2, "off"),
        (2, "speculative"),
    ]
    assert all(run["output_tokens"] == 12 and run["errors"] == {} for run in report["runs"])
    assert [entry["concurrency"] for entry in report["comparison"]] == [1, 2]
    assert all(entry["throughput_ratio"] > 0 for entry in report["comparison"])
    assert report["settings"]["prompts_file"].endswith("prose.jsonl") and report["settings"]["draft_tokens"] == 2
    assert (tmp_path / "compare.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--compare", "--no-speculation"], "drop --no-speculation"),
        (["--compare", "--rate", "2"], "drop --rate"),
        (["--compare", "--draft-tokens", "0"], "off with off"),
        (["--repeats", "3"], "--repeats applies to --compare"),
    ],
)
def test_command_line_refuses_compare_with_contradicting_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["loadtest", "--server", "127.0.0.1:1", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- OpenAI-compatible targets


def test_vllm_fields_name_the_figures_as_vllm_bench_serve_does():
    results = [
        loadtest.RequestResult(started=0.0, ended=1.0, delta_times=[0.2, 0.6, 1.0], delta_tokens=[1, 2, 2],
                               completion_tokens=5, index=1, text="b", prompt_tokens=7),
        loadtest.RequestResult(started=0.0, ended=0.5, delta_times=[0.1, 0.5], delta_tokens=[1, 1],
                               completion_tokens=2, index=0, text="a", prompt_tokens=3),
        loadtest.RequestResult(started=0.0, ended=0.1, index=2, error="UNAVAILABLE"),
    ]  # fmt: skip
    fields = loadtest.vllm_fields(results, wall=2.0)
    assert fields["duration"] == 2.0 and fields["total_output_tokens"] == 7 and fields["total_input_tokens"] == 10
    assert fields["output_throughput"] == 3.5 and fields["request_throughput"] == 1.0
    assert fields["mean_ttft_ms"] == pytest.approx(150.0) and fields["median_ttft_ms"] == pytest.approx(150.0)
    assert fields["p99_e2el_ms"] == pytest.approx(995.0) and fields["std_e2el_ms"] == pytest.approx(250.0)
    assert fields["mean_tpot_ms"] == pytest.approx((800 / 4 + 400 / 1) / 2)
    assert fields["p50_itl_ms"] == pytest.approx(200.0)  # 200, 200, 200, 200 and 400 ms
    # per request, in request order, failures as 0 / ""
    assert fields["output_lens"] == [2, 5, 0] and fields["input_lens"] == [3, 7, 0]
    assert fields["generated_texts"] == ["a", "b", ""]
    empty = loadtest.vllm_fields([], wall=1.0)
    assert empty["mean_ttft_ms"] is None and empty["p99_itl_ms"] is None and empty["output_lens"] == []


def test_openai_base_url_takes_the_server_or_its_v1():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert openai_client.base_url(url) == "http://h:8000/v1"
    assert openai_client.base_url("https://h/openai") == "https://h/openai/v1"
    for bad in ("h:8000", "ftp://h/v1", "http://"):
        with pytest.raises(openai_client.TargetError, match="not an http"):
            openai_client.base_url(bad)


async def test_openai_target_gives_the_grpc_targets_tokens_and_greedy_text(tiny_stack, tiny_http, tmp_path):
    """One run, both APIs of one stack interleaved: the same token counts and greedy text per request."""
    url, model = tiny_http
    grpc_address = f"127.0.0.1:{tiny_stack.orchestrator.port}"
    targets = [loadtest.GrpcTarget(grpc_address), openai_client.OpenAiTarget(url)]
    settings = settings_for(grpc_address)
    report = await loadtest.run_loadtest(settings, requests=3, concurrency=[1, 2], rates=[20.0], targets=targets)
    report = json.loads(json.dumps(report))  # the report is plain JSON
    runs = report["runs"]
    assert [(r["concurrency"], r["rate"], r["backend"]) for r in runs] == [
        (1, None, "grpc"), (1, None, "openai"), (2, None, "grpc"), (2, None, "openai"),
        (None, 20.0, "grpc"), (None, 20.0, "openai"),
    ]  # fmt: skip
    assert [r["target"] for r in runs[:2]] == [grpc_address, url]
    for grpc_run, http_run in zip(runs[::2], runs[1::2]):
        for run in (grpc_run, http_run):
            assert run["errors"] == {} and run["completed"] == 3
            assert run["output_lens"] == [8, 8, 8]  # ignore_eos: max_tokens each, as counted by the server
            assert run["output_throughput"] == run["output_tokens_per_s"] > 0
            assert run["mean_ttft_ms"] == pytest.approx(run["ttft_s"]["mean"] * 1000)
            assert 0 < run["p50_e2el_ms"] <= run["p99_e2el_ms"] and run["p50_tpot_ms"] > 0
        assert http_run["generated_texts"] == grpc_run["generated_texts"]  # greedy: the very same text
        assert any(http_run["generated_texts"]) and len(set(http_run["generated_texts"])) > 1  # 3 prompts
        assert http_run["input_lens"] == grpc_run["input_lens"] and all(http_run["input_lens"])
        check_run(grpc_run, requests=3, max_new_tokens=8)  # gRPC runs keep specd's figures
        assert "acceptance_rate" not in http_run and "target_calls_per_pass" not in http_run  # not on the wire
        assert grpc_run["mode"] == "speculative" and http_run["mode"] is None
    described = {target["backend"]: target for target in report["settings"]["targets"]}
    assert described["openai"]["model"] == model and model in described["openai"]["models"]
    assert described["grpc"]["server_info"] == report["settings"]["server_info"] is not None
    table = loadtest_report.summary_table(report)
    assert table.row_count == 6 and table.columns[0].header == "target"
    loadtest_report.save_plot(report, tmp_path / "targets.png")
    assert (tmp_path / "targets.png").read_bytes().startswith(PNG_SIGNATURE)
    assert list(loadtest_report.targets(runs)) == [grpc_address, url]  # a series each


async def test_command_line_runs_the_targets_in_the_order_given(tiny_stack, tiny_http, tmp_path):
    url, model = tiny_http
    grpc_address = f"127.0.0.1:{tiny_stack.orchestrator.port}"
    argv = ["loadtest", "--openai", url, "--model", model, "--server", grpc_address, "--concurrency", "1",
            "--requests", "2", "--max-new-tokens", "5", "--warmup", "0",
            "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png")]  # fmt: skip
    assert await asyncio.to_thread(cli, argv) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert [run["target"] for run in report["runs"]] == [f"{url} ({model})", grpc_address]
    assert [run["output_lens"] for run in report["runs"]] == [[5, 5], [5, 5]]
    assert report["runs"][0]["generated_texts"] == report["runs"][1]["generated_texts"]
    assert report["settings"]["server"] == grpc_address
    assert (tmp_path / "out.png").read_bytes().startswith(PNG_SIGNATURE)


async def test_command_line_names_the_targets_it_is_given_names_for(tiny_stack, tiny_http, tmp_path):
    url, model = tiny_http
    grpc_address = f"127.0.0.1:{tiny_stack.orchestrator.port}"
    argv = ["loadtest", "--server", f"specd-grpc={grpc_address}", "--openai", f"specd.http={url}/v1",
            "--model", model, "--concurrency", "1", "--requests", "1", "--max-new-tokens", "3", "--warmup", "0",
            "--json", str(tmp_path / "named.json")]  # fmt: skip
    assert await asyncio.to_thread(cli, argv) == 0
    report = json.loads((tmp_path / "named.json").read_text())
    assert [run["target"] for run in report["runs"]] == ["specd-grpc", "specd.http"]
    assert report["settings"]["server"] == grpc_address
    assert [target["name"] for target in report["settings"]["targets"]] == ["specd-grpc", "specd.http"]
    assert list(loadtest_report.targets(report["runs"])) == ["specd-grpc", "specd.http"]


def test_a_target_name_is_only_a_plain_word_before_the_address():
    from specd.cli.loadtest import _named

    assert _named("llama=http://127.0.0.1:8080") == ("llama", "http://127.0.0.1:8080")
    assert _named("a.b-c_1=h:1") == ("a.b-c_1", "h:1")
    assert _named("h:50051") == (None, "h:50051")
    assert _named("http://h/v1?x=1") == (None, "http://h/v1?x=1")


async def test_command_line_says_why_an_openai_target_cannot_be_used():
    from specd.cli.common import UserError

    refused = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=r"cannot connect to http:.*is the server running"):
        await asyncio.to_thread(cli, ["loadtest", "--openai", refused, "--concurrency", "1", "--requests", "1"])
    with pytest.raises(UserError, match="not an http"):
        cli(["loadtest", "--openai", "localhost:8000"])
    with pytest.raises(UserError, match="given twice"):
        cli(["loadtest", "--openai", "http://a:1", "--openai", "http://a:1/"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency", "1"], "give a target"),
        (["--server", "127.0.0.1:1", "--model", "m"], "--model goes with --openai"),
        (["--openai", "http://a:1", "--model", "m", "--model", "n"], "--model given 2 times for 1"),
        (["--openai", "http://a:1", "--openai", "http://b:1", "--api-key", "k", "--api-key", "l", "--api-key", "m"],
         "--api-key given 3 times for 2"),
        (["--server", "127.0.0.1:1", "--openai", "http://a:1", "--compare"], "--compare measures"),
    ],
)  # fmt: skip
def test_command_line_refuses_unusable_target_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["loadtest", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


async def test_unique_prompts_never_repeat_so_no_server_serves_one_from_its_cache(tiny_stack, tiny_http):
    """Issue 50's fair benchmark: one prompt sent again and again is served from the prefix cache
    (gRPC Final stats and OpenAI usage both say so, and the report sums it); with --unique-prompts
    every request, warm-ups included, opens with a line of its own run's tag and nothing is cached."""
    url, _ = tiny_http
    grpc_address = f"127.0.0.1:{tiny_stack.orchestrator.port}"
    prompt = "# unique-prompts test of tests/test_loadtest.py\ndef again():"
    settings = settings_for(grpc_address, prompts=[prompt], max_new_tokens=4)
    assert settings.prompt(5) == prompt
    tagged = loadtest.Settings(**{**settings.__dict__, "unique_tag": "t1"})
    lines = [tagged.prompt(index).split("\n", 1) for index in range(64)]
    assert all(rest == prompt for _, rest in lines) and len({line for line, _ in lines}) == 64
    # of 64, no two share more than "# " and three hex digits: nothing a prefix cache could reuse
    assert max(len(os.path.commonprefix([a, b])) for (a, _), (b, _) in itertools.combinations(lines, 2)) <= 5
    for unique in (False, True):
        targets = [loadtest.GrpcTarget(grpc_address), openai_client.OpenAiTarget(url)]
        report = await loadtest.run_loadtest(
            settings, requests=3, concurrency=[1, 2], targets=targets, warmup=1, unique_prompts=unique
        )
        assert report["settings"]["unique_prompts"] is unique
        for run in report["runs"]:
            assert run["errors"] == {} and run["prompt_tokens"] == sum(run["input_lens"]) > 0
            if unique:
                assert run["cached_prompt_tokens"] == 0, run["target"]
            else:  # the warm-up sent it first: every request of the run takes all but its last token
                assert run["cached_prompt_tokens"] == run["prompt_tokens"] - 3, run["target"]
        assert loadtest_report.summary_table(report).row_count == 4


def test_shared_prefixes_open_each_prompt_with_one_of_n_contexts_the_same_for_every_target():
    """Issue 39's shared-prefix workload: N contexts of ~1,000 tokens with no first line in common,
    each prompt opened by one of them (every one used), then its own line; which one depends on the
    seed and the request's number, not on the run's tag, so every target gets the same sequence."""
    contexts = loadtest.shared_contexts(8)
    assert len(set(contexts)) == 8 and min(len(c) for c in contexts) > 2000
    assert len({c.split("\n", 1)[0] for c in contexts}) == 8
    one, other = (settings_for("", shared_prefixes=contexts, unique_tag=tag) for tag in ("a", "b"))
    picks = [[next(c for c in contexts if s.prompt(i).startswith(c)) for i in range(64)] for s in (one, other)]
    assert picks[0] == picks[1] and set(picks[0]) == set(contexts)
    assert picks[0] != [contexts[i % 8] for i in range(64)]  # no cycle for round robin to fall in step with
    assert one.prompt(3) != other.prompt(3) and one.prompt(3).startswith(picks[0][3] + "# ")
    reseeded = settings_for("", shared_prefixes=contexts, seed=1)
    assert [next(c for c in contexts if reseeded.prompt(i).startswith(c)) for i in range(64)] != picks[0]
