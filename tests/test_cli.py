"""The console command end to end: `specd generate` starts draft, target and orchestrator as
processes (on tiny models), streams, compares with target-only, and stops everything."""

import asyncio
import json
import os
import subprocess
import sys
import uuid

import psutil


def specd(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "specd.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def marked(mark: str) -> list[psutil.Process]:
    """The processes whose environment carries SPECD_TEST_MARK=mark: one command's and its children's,
    whatever else runs on the machine (another test's services beside this one)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("SPECD_TEST_MARK") == mark:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def test_help_lists_every_command():
    result = specd("--help")
    assert result.returncode == 0
    for verb in ("models", "serve", "up", "generate"):
        assert verb in result.stdout


def test_generate_json_on_an_embedded_stack_matches_target_only(tiny_dirs):
    mark = uuid.uuid4().hex  # inherited by the services the embedded stack starts
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
        env={**os.environ, "SPECD_TEST_MARK": mark},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = json.loads(result.stdout)
    assert set(output) >= {"text", "token_ids", "finish_reason", "usage", "stats", "baseline", "speedup_vs_target"}
    assert output["usage"]["completion_tokens"] == len(output["token_ids"]) <= 12
    stats = output["stats"]
    assert stats["adaptive"] and stats["draft_tokens"] == 8  # K chosen every step, up to 8 (the default)
    # how many steps drafted is the chooser's: it prices them from the services' measured passes
    # (model/pass_profile.py), and this tiny draft costs about what its target does
    assert len(stats["draft_lengths"]) == stats["steps"] and sum(stats["draft_lengths"]) == stats["drafted"] >= 0
    assert 0 <= output["stats"]["acceptance_rate"] <= 1
    assert output["baseline"]["same_text"] is True  # greedy speculative == target-only
    leftovers = marked(mark)
    assert not leftovers, "the embedded stack must stop all its processes"


async def test_bad_request_is_a_clear_error_not_a_traceback(tiny_stack):
    """The server's INVALID_ARGUMENT, shown as one line and exit 2: against the session's running stack
    (`--server`), which answers it as an embedded stack would, without starting one for a refusal."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "specd.cli",
        "generate",
        "hi",
        "--max-new-tokens",
        "0",
        "--server",
        f"127.0.0.1:{tiny_stack.orchestrator.port}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 2
    assert b"INVALID_ARGUMENT" in stderr and b"max_new_tokens" in stderr
    assert b"Traceback" not in stderr
