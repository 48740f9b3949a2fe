"""`specd bench` and `specd loadtest` without a terminal (CI, nohup, `> log`): a progress line at least
every Progress.interval seconds, and tables printed whole. Fake targets and fake runs: no server, no model."""

import argparse
import asyncio
import io
import re
import time

import pytest
from rich.console import Console

from specd.bench import loadtest, loadtest_report, output, systems
from specd.bench import report as bench_report
from specd.bench.workload import RequestResult
from specd.cli import bench as bench_cli
from specd.cli import loadtest as loadtest_cli

LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] (.+) \((\d+)/(\d+) done, \d+:\d\d:\d\d elapsed\)$")


@pytest.fixture
def quick_lines(monkeypatch):
    """Progress lines every 50 ms instead of every 20 s."""
    monkeypatch.setattr(output.Progress, "interval", 0.05)


def progress_lines(text: str) -> list[tuple[str, int, int]]:
    return [(m[1], int(m[2]), int(m[3])) for line in text.splitlines() if (m := LINE.match(line))]


def cli(add_parser, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specd")
    add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def headers(table) -> list[str]:
    return [str(column.header) for column in table.columns]


# ---------------------------------------------------------------- progress


def test_off_a_terminal_progress_is_a_line_at_least_every_interval_even_when_nothing_advances(quick_lines):
    console = Console(file=io.StringIO())
    assert not console.is_terminal
    with output.Progress(console) as progress:
        assert progress.bar is None
        progress.say("warming up")
        advance = progress.task("concurrency 4", 3)
        time.sleep(0.3)  # one request that takes "minutes": the lines go on
        advance(), advance(), advance()
    text = console.file.getvalue()
    assert "\x1b" not in text and "━" not in text  # no escape codes, no bar
    assert re.search(r"^\[\d\d:\d\d:\d\d\] warming up$", text, re.M)
    lines = progress_lines(text)
    assert lines[0] == ("concurrency 4", 0, 3) and lines[-1] == ("concurrency 4", 3, 3)
    assert len([line for line in lines if line[1] == 0]) >= 3  # the start, then one every 50 ms while waiting


def test_on_a_terminal_progress_is_rich_s_live_bar():
    console = Console(file=io.StringIO(), force_terminal=True)
    with output.Progress(console) as progress:
        advance = progress.task("concurrency 1", 2)
        advance(), advance("concurrency 1 done")
        assert progress.bar is not None and progress.bar.tasks[0].completed == 2
        assert progress.bar.tasks[0].description == "concurrency 1 done"


# ---------------------------------------------------------------- specd loadtest


class SlowTarget:
    """A target whose every request takes 20 ms and yields 4 tokens in 2 deltas (speculation figures: none)."""

    backend, speculation, name, info = "openai", False, "slow", None

    async def open(self, timeout: float) -> None:
        pass

    async def close(self) -> None:
        pass

    async def passes(self, timeout: float) -> None:
        return None

    async def send(self, settings, index: int) -> RequestResult:
        result = RequestResult(started=time.perf_counter(), index=index)
        for _ in range(2):
            await asyncio.sleep(0.01)
            result.delta_times.append(time.perf_counter())
            result.delta_tokens.append(2)
        result.ended, result.completion_tokens, result.text = time.perf_counter(), 4, "text"
        return result

    def describe(self) -> dict:
        return {"name": self.name, "backend": self.backend}


def test_loadtest_without_a_terminal_prints_progress_lines_and_a_whole_table(quick_lines, monkeypatch, capsys):
    monkeypatch.setattr(loadtest_cli, "_targets", lambda args, module: [SlowTarget()])
    argv = ["loadtest", "--server", "127.0.0.1:1", "--concurrency", "1,2", "--requests", "8", "--warmup", "0"]
    assert cli(loadtest_cli.add_parser, argv) == 0
    text = capsys.readouterr().err  # not a terminal: pytest captures it
    lines = progress_lines(text)
    assert ("concurrency 1", 0, 8) in lines and ("concurrency 1", 8, 8) in lines
    assert ("concurrency 2", 0, 8) in lines and ("concurrency 2", 8, 8) in lines
    assert any(0 < done < 8 for _, done, _ in lines)  # 160 ms at concurrency 1: lines while it runs
    assert "…" not in text
    for header in ("run", "ok/sent", "TTFT p50/p99 ms", "calls/pass D/T", "target rows/pass", "errors"):
        assert header in text


def fake_loadtest_report() -> dict:
    results = [
        RequestResult(started=0.0, ended=1.0, delta_times=[0.2, 0.6], delta_tokens=[1, 3], completion_tokens=4, index=i)
        for i in range(4)
    ]
    runs = []
    for level in (1, 16):
        for mode in loadtest.MODES:
            run = loadtest.summarize_run(results, 2.0, level, None, speculation=False)
            run.update(target="a-long-target-name=http://127.0.0.1:8000", backend="grpc", mode=mode, repeat=0)
            run.update(acceptance_rate=0.7, mean_draft_length=3.2, speculation_off_share=0.1, lookup_step_share=0.5)
            run.update(errors={"DEADLINE_EXCEEDED": 2, "RESOURCE_EXHAUSTED": 1}, target_tokens_per_pass=3.5)
            runs.append(run)
    runs.append({**runs[0], "target": "another-target=http://10.0.0.2:8080"})
    settings = {"repeats": 1, "machine": {"cpu_model": "Intel(R) Xeon(R) Platinum 8488C"}}
    return {"runs": runs, "comparison": loadtest.comparison(runs), "settings": settings}


def test_loadtest_tables_written_to_a_log_keep_every_cell_whole():
    report = fake_loadtest_report()
    tables = [loadtest_report.summary_table(report), loadtest_report.comparison_table(report)]
    narrow = Console(file=io.StringIO())  # what rich does off a terminal: 80 columns, cells cut to "…"
    narrow.print(tables[0])
    assert "…" in narrow.file.getvalue()
    log = Console(file=io.StringIO())
    output.print_tables(log, *tables)
    text = log.file.getvalue()
    assert "…" not in text and log.width == 80  # the console's own width comes back for what follows
    for table in tables:
        assert all(header in text for header in headers(table))
    assert "DEADLINE_EXCEEDED×2, RESOURCE_EXHAUSTED×1" in text and "a-long-target-name=http://127.0.0.1:8000" in text


# ---------------------------------------------------------------- specd bench


def spec_stats(steps: int, drafted: int, accepted: int) -> dict:
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "accepted_per_position": [accepted],
        "draft_seconds": 0.1 * drafted,
        "verify_seconds": 0.2 * steps,
        "other_seconds": 0.0,
        "draft_lengths": [drafted // steps] * steps,
        "step_draft_seconds": [0.1 * drafted / steps] * steps,
        "step_verify_seconds": [0.2] * steps,
    }


async def fake_run_bench(settings, advance=None, say=print, models=None) -> dict:
    """systems.run_bench's calls to say and advance, each system taking 20 ms a prompt."""
    say("warming up each system once")
    ids = [1, 2, 3, 4]
    runs = {system: [] for system in bench_report.SYSTEMS}
    for index in range(len(settings.prompts)):
        for system in systems.run_order():
            time.sleep(0.02)  # as HF generate() does: the event loop is held, the progress thread is not
            stats = spec_stats(4, 0, 0) if system == "specd_target" else spec_stats(2, 4, 2)
            runs[system].append(systems.Run(ids, 1.0, stats if system.startswith("specd") else None))
            advance(f"prompt {index + 1}/{len(settings.prompts)} {system}")
    return bench_report.build_report(settings, runs, [[7]] * len(settings.prompts), {"dtype": "float32"})


def test_bench_without_a_terminal_prints_progress_lines_and_whole_tables(quick_lines, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(systems, "run_bench", fake_run_bench)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):", "kind": "code"}\n{"prompt": "Once upon", "kind": "prose"}\n')
    argv = ["bench", "--server", "127.0.0.1:1", "--prompts", str(prompts), "--max-new-tokens", "4"]
    assert cli(bench_cli.add_parser, argv) == 0
    text = capsys.readouterr().err
    assert re.search(r"^\[\d\d:\d\d:\d\d\] warming up each system once$", text, re.M)
    lines = progress_lines(text)
    assert lines[0] == ("starting", 0, 10) and lines[-1] == ("prompt 2/2 specd_target", 10, 10)
    assert any(0 < done < 10 for _, done, _ in lines)  # 200 ms of runs: lines while they go
    assert "…" not in text
    for header in ("system", "what", "vs hf_target", "kind", "prompt", "spec/hf_best", "match"):
        assert header in text
    assert "specd_spec / hf_best (faster of hf_assisted, hf_lookup)" in text  # the figures' names whole too
