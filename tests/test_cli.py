"""The console command end to end: `specd generate` starts draft, target and orchestrator as
processes (on tiny models), streams, compares with target-only, and stops everything."""

import json
import subprocess
import sys

import psutil


def specd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command():
    result = specd("--help")
    assert result.returncode == 0
    for verb in ("models", "serve", "up", "generate"):
        assert verb in result.stdout


def test_generate_json_on_an_embedded_stack_matches_target_only(tiny_dirs):
    before = {p.pid for p in psutil.process_iter()}
    result = specd(
        "generate",
        "def fibonacci(n):",
        "--json",
        "--max-new-tokens",
        "12",
        "--dtype",
        "float32",
        "--draft-model",
        str(tiny_dirs["draft"]),
        "--target-model",
        str(tiny_dirs["target"]),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = json.loads(result.stdout)
    assert set(output) >= {"text", "token_ids", "finish_reason", "usage", "stats", "baseline", "speedup_vs_target"}
    assert output["usage"]["completion_tokens"] == len(output["token_ids"]) <= 12
    stats = output["stats"]
    assert stats["adaptive"] and stats["draft_tokens"] == 8  # K chosen every step, up to 8 (the default)
    assert len(stats["draft_lengths"]) == stats["steps"] and sum(stats["draft_lengths"]) == stats["drafted"] > 0
    assert 0 <= output["stats"]["acceptance_rate"] <= 1
    assert output["baseline"]["same_text"] is True  # greedy speculative == target-only
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.pid not in before
        and "specd" in " ".join(p.info["cmdline"] or [])
        and "serve" in " ".join(p.info["cmdline"] or [])
    ]
    assert not leftovers, "the embedded stack must stop all its processes"


def test_bad_request_is_a_clear_error_not_a_traceback(tiny_dirs):
    result = specd(
        "generate",
        "hi",
        "--max-new-tokens",
        "0",
        "--dtype",
        "float32",
        "--draft-model",
        str(tiny_dirs["draft"]),
        "--target-model",
        str(tiny_dirs["target"]),
    )
    assert result.returncode == 2
    assert "INVALID_ARGUMENT" in result.stderr and "max_new_tokens" in result.stderr
    assert "Traceback" not in result.stderr
