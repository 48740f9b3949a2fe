"""The peer benchmark (`specd bench`): its maths on hand numbers, and short runs on the tiny stack."""

import argparse
import asyncio
import io
import json
import subprocess
import sys

import pytest
import torch

from specd.bench import report as bench_report
from specd.bench import systems
from specd.cli import bench as bench_cli
from specd.model.loading import load_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOP_KEYS = {
    "results",
    "ratios",
    "alpha",
    "c",
    "mean_accepted_length",
    "analytic_speedup",
    "greedy_match",
    "per_prompt",
    "settings",
}
REQUIRED_RATIOS = {
    "specd_spec/hf_assisted": ("specd_spec", "hf_assisted"),
    "specd_spec/hf_target": ("specd_spec", "hf_target"),
    "specd_spec/specd_target": ("specd_spec", "specd_target"),
    "specd_spec/hf_lookup": ("specd_spec", "hf_lookup"),
    "hf_lookup/hf_target": ("hf_lookup", "hf_target"),
}


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specd")
    bench_cli.add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def address(tiny_stack) -> str:
    return f"127.0.0.1:{tiny_stack.orchestrator.port}"


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


# ---------------------------------------------------------------- maths


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
        prompts=["a", "b"], kinds=["code", "prose"], max_new_tokens=4, draft_tokens=2, draft_engine="llama.cpp"
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


# ---------------------------------------------------------------- the edit prompts


def test_the_edit_prompts_load_and_have_the_default_prompts_shape(tiny_dirs):
    from transformers import AutoTokenizer

    prompts, kinds = systems.load_prompts(systems.EDIT_PROMPTS)
    assert len(prompts) >= 16 and kinds == ["edit"] * len(prompts)
    assert len(set(prompts)) == len(prompts)
    default_keys = {key for line in bench_cli_default_prompts().read_text().splitlines() for key in json.loads(line)}
    lines = [json.loads(line) for line in systems.EDIT_PROMPTS.read_text().splitlines() if line.strip()]
    assert all(set(line) == default_keys == {"prompt", "kind"} for line in lines)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["target"])  # the real Qwen2.5 tokenizer
    for prompt in prompts:
        # the user turn gives the code; the assistant turn is already open (mostly on a code fence)
        assert prompt.startswith("<|im_start|>user\n") and "```" in prompt.split("<|im_end|>")[0], prompt[:60]
        assert "<|im_end|>\n<|im_start|>assistant\n" in prompt and not prompt.endswith("<|im_end|>\n")
        tokens = len(tokenizer(prompt, add_special_tokens=False).input_ids)
        assert 100 <= tokens <= 400, (tokens, prompt[:60])
    opened = [p for p in prompts if p.split("<|im_start|>assistant\n")[1].startswith("```")]
    assert len(opened) >= len(prompts) - 2  # the continuation starts by rewriting the code


# ---------------------------------------------------------------- the HF baselines


def test_hf_baselines_ignore_eos_and_leave_the_models_config_alone(tiny_dirs):
    """Like specd's ignore_eos: generation goes on through EOS, so every system makes N tokens."""
    draft, target = load_model(str(tiny_dirs["draft"]), "float32"), load_model(str(tiny_dirs["target"]), "float32")
    hf = systems.HFSystems(draft, target)
    prompt = hf.encode("def quicksort(arr):\n")
    first = hf.run(prompt, 1, assisted=False).token_ids[0]
    eos = target.eos_token_ids[0]
    with torch.no_grad():  # make EOS the target's (and draft's) greedy choice wherever `first` scored well
        for loaded in (draft, target):
            embeddings = loaded.model.get_input_embeddings().weight
            embeddings[eos] = 100 * embeddings[first]
    saved = target.model.generation_config
    for system in ({}, {"assisted": True}, {"lookup_tokens": 3}):
        output = hf.run(prompt, 6, **system).token_ids
        assert len(output) == 6 and output[0] == eos, system
    assert target.model.generation_config is saved and saved.eos_token_id is not None
    with pytest.raises(ValueError, match="choose one"):
        hf.run(prompt, 6, assisted=True, lookup_tokens=3)


def test_hf_lookup_is_greedy_and_reports_its_settings(tiny_loaded):
    """Prompt lookup only proposes tokens; the target's greedy choice decides, so its output is hf_target's."""
    hf = systems.HFSystems(tiny_loaded["draft"], tiny_loaded["target"])
    prompts, _ = systems.load_prompts(systems.EDIT_PROMPTS)
    for prompt in prompts[:2]:
        ids = hf.encode(prompt)
        plain = hf.run(ids, 12).token_ids
        assert hf.run(ids, 12, lookup_tokens=systems.LOOKUP_TOKENS).token_ids == plain
    assert hf.lookup_settings(10) == {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}


# ---------------------------------------------------------------- end to end on the tiny stack


async def test_bench_on_the_tiny_stack(tiny_stack, tiny_loaded, tmp_path):
    prompts, kinds = systems.load_prompts(bench_cli_default_prompts())
    settings = systems.BenchSettings(
        prompts=prompts[:2],
        kinds=kinds[:2],
        max_new_tokens=8,
        draft_tokens=3,
        dtype="float32",
        server=address(tiny_stack),
        timeout=60.0,
    )
    labels = []
    report = await systems.run_bench(
        settings, advance=labels.append, say=lambda message: None, models=(tiny_loaded["draft"], tiny_loaded["target"])
    )
    assert len(labels) == 2 * len(bench_report.SYSTEMS) == 2 * 5 and labels[-1] == "prompt 2/2 specd_target"
    json.loads(json.dumps(report))  # serializable as it stands

    assert set(report) >= TOP_KEYS
    assert set(report["results"]) == set(bench_report.SYSTEMS)
    for system, result in report["results"].items():
        assert result["tokens"] == 2 * 8, system  # EOS ignored: every system makes N tokens per prompt
        assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["seconds"])
    speed = {system: result["tokens_per_s"] for system, result in report["results"].items()}
    for name, (top, bottom) in REQUIRED_RATIOS.items():
        assert report["ratios"][name] == pytest.approx(speed[top] / speed[bottom])

    assert report["greedy_match"] is True  # float32: specd's output is the target's greedy output
    assert report["hf_lookup_match"] is True  # and so is prompt lookup's
    assert report["ratios"]["specd_spec/hf_best"] == pytest.approx(
        speed["specd_spec"] / max(speed["hf_assisted"], speed["hf_lookup"])
    )
    assert report["median_ratios"]["specd_spec/hf_best"] > 0
    assert 0 <= report["alpha"] <= 1 and report["c"] > 0
    assert 1 <= report["mean_accepted_length"] <= 1 + 3
    assert report["analytic_speedup"] == pytest.approx(bench_report.analytic_best(report["alpha"], report["c"])[0])
    assert len(report["acceptance_by_position"]) == 3

    assert len(report["per_prompt"]) == 2
    for entry in report["per_prompt"]:
        assert set(entry["tokens_per_s"]) == set(bench_report.SYSTEMS)
        assert entry["matches_hf_target"]["specd_spec"] and entry["matches_hf_target"]["specd_target"]
        assert len(entry["hf_target_token_ids"]) == 8 and entry["kind"] == "code"
    assert report["settings"]["max_new_tokens"] == 8 and report["settings"]["draft_tokens"] == 3
    assert report["settings"]["dtype"] == "float32" and report["settings"]["prompts"] == 2
    assert report["settings"]["server_info"]["dtype"] == "float32"
    assert report["settings"]["hf_assisted_generation"]["num_assistant_tokens"] >= 1
    assert report["settings"]["hf_prompt_lookup"]["prompt_lookup_num_tokens"] == systems.LOOKUP_TOKENS
    assert report["settings"]["order"].endswith("hf_target hf_assisted hf_lookup specd_spec specd_target")

    bench_report.save_plot(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes().startswith(PNG_SIGNATURE)
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160)
    for table in bench_report.summary_tables(report):
        console.print(table)
    text = console.file.getvalue()
    assert "specd_spec / hf_assisted" in text and "analytic best" in text and "specd_spec / hf_best" in text


async def test_command_line_writes_json_and_plot(tiny_stack, tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "def fibonacci(n):\\n", "kind": "code"}\n{"prompt": "Once upon a time", "kind": "prose"}\n'
    )
    argv = [
        "bench",
        "--server",
        address(tiny_stack),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--draft-tokens",
        "2",
        "--dtype",
        "float32",
        "--draft-model",
        str(tiny_dirs["draft"]),
        "--target-model",
        str(tiny_dirs["target"]),
        "--json",
        str(tmp_path / "out.json"),
        "--plot",
        str(tmp_path / "out.png"),
    ]
    # the command runs its own event loop (asyncio.run): keep it off the loop serving the tiny stack
    assert await asyncio.to_thread(cli, argv) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert set(report) >= TOP_KEYS and report["greedy_match"] is True
    assert [entry["kind"] for entry in report["per_prompt"]] == ["code", "prose"]
    assert report["settings"]["quick"] is False and report["settings"]["wall_seconds"] > 0
    assert all(result["tokens"] == 12 for result in report["results"].values())
    assert (tmp_path / "out.png").read_bytes().startswith(PNG_SIGNATURE)


def test_quick_takes_the_first_prompts_and_fewer_tokens():
    args = argparse.Namespace(
        quick=True,
        prompts=None,
        max_new_tokens=None,
        draft_tokens=4,
        timeout=600.0,
        dtype=None,
        threads=None,
        draft_model="draft",
        target_model="target",
        server=None,
        draft_quantize="auto",
        device="auto",
        draft_device="auto",
        cuda_graphs="auto",
        engine="transformers",
        draft_engine="llama.cpp",
        drafter="ngram",
    )
    settings = bench_cli._settings(args)
    assert len(settings.prompts) == systems.QUICK_PROMPTS and settings.max_new_tokens == systems.QUICK_TOKENS
    assert settings.drafter == "ngram"
    assert (settings.draft_engine, settings.target_engine) == ("llama.cpp", "transformers")  # specd's services'
    args.quick = False
    settings = bench_cli._settings(args)
    assert len(settings.prompts) == 24 and settings.max_new_tokens == systems.DEFAULT_TOKENS


def test_command_line_rejects_bad_flags(tmp_path):
    from specd.cli.common import UserError

    with pytest.raises(UserError, match="not found"):
        cli(["bench", "--prompts", str(tmp_path / "nope.jsonl")])
    with pytest.raises(UserError, match="--draft-tokens"):
        cli(["bench", "--draft-tokens", "0"])


# ---------------------------------------------------------------- peers: any OpenAI-compatible server


async def test_a_peer_is_a_system_of_its_own(tiny_stack, tiny_loaded, tiny_http, tmp_path):
    """specd's own HTTP API as the peer (standing in for vLLM or llama-server): greedy over the same
    prompt tokens, it makes specd_target's text, token for token as many."""
    url, model = tiny_http
    prompts, kinds = systems.load_prompts(bench_cli_default_prompts())
    settings = systems.BenchSettings(
        prompts=prompts[:2], kinds=kinds[:2], max_new_tokens=8, draft_tokens=3, dtype="float32",
        server=address(tiny_stack), peers={"specd_http": url}, timeout=60.0,
    )  # fmt: skip
    labels = []
    report = await systems.run_bench(
        settings, advance=labels.append, say=lambda message: None, models=(tiny_loaded["draft"], tiny_loaded["target"])
    )
    report = json.loads(json.dumps(report))  # serializable as it stands
    assert len(labels) == 2 * 6 and labels[-1] == "prompt 2/2 specd_http"  # interleaved, the peer last
    peer = report["results"]["specd_http"]
    assert peer["tokens"] == 2 * 8 and peer["tokens_per_s"] == pytest.approx(peer["tokens"] / peer["seconds"])
    assert report["peers"] == {"specd_http": {"matches_specd_target": True, "same_token_counts": True}}
    speed = {system: result["tokens_per_s"] for system, result in report["results"].items()}
    assert report["ratios"]["specd_spec/specd_http"] == pytest.approx(speed["specd_spec"] / speed["specd_http"])
    assert report["ratios"]["specd_http/hf_target"] == pytest.approx(speed["specd_http"] / speed["hf_target"])
    assert report["median_ratios"]["specd_spec/specd_http"] > 0
    for entry in report["per_prompt"]:
        assert entry["tokens"]["specd_http"] == 8 and entry["peer_matches_specd_target"] == {"specd_http": True}
        assert entry["tokens_per_s"]["specd_http"] > 0 and "specd_http" not in entry["matches_hf_target"]
    assert report["greedy_match"] is True  # the built-in systems' figures stand as before
    assert report["settings"]["peers"] == {"specd_http": url}
    assert report["settings"]["peer_models"] == {"specd_http": model}
    assert report["settings"]["order"].endswith("specd_spec specd_target specd_http")

    from rich.console import Console

    console = Console(file=io.StringIO(), width=220)
    for table in bench_report.summary_tables(report):
        console.print(table)
    text = console.file.getvalue()
    assert "specd_spec / specd_http" in text and "specd_http text == specd_target" in text
    assert bench_report._shown(report)[-1] == "specd_http"  # its own bar in the plot
    bench_report.save_plot(report, tmp_path / "peer.png")
    assert (tmp_path / "peer.png").read_bytes().startswith(PNG_SIGNATURE)


def test_peer_flags_that_cannot_work_say_why(tiny_dirs, capsys):
    from specd.cli.common import UserError

    with pytest.raises(SystemExit) as exit_info:
        cli(["bench", "--peer", "http://127.0.0.1:8080"])
    assert exit_info.value.code == 2 and "expected NAME=URL" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["bench", "--peer", "a/b=http://127.0.0.1:8080"])
    assert "no /" in capsys.readouterr().err
    with pytest.raises(UserError, match="'specd_spec' is taken"):
        cli(["bench", "--peer", "specd_spec=http://127.0.0.1:8080"])
    with pytest.raises(UserError, match="http"):
        cli(["bench", "--peer", "llama=127.0.0.1:8080"])
    refused = f"http://127.0.0.1:{free_port()}"
    tiny = ["--draft-model", str(tiny_dirs["draft"]), "--target-model", str(tiny_dirs["target"])]
    with pytest.raises(UserError, match=r"--peer llama=.*cannot connect"):  # before anything loads
        cli(["bench", "--server", "127.0.0.1:1", "--peer", f"llama={refused}", "--quick", *tiny])


def free_port() -> int:
    from specd.deploy.local import free_port as pick

    return pick()


def bench_cli_default_prompts():
    from specd.bench.loadtest import DEFAULT_PROMPTS

    return DEFAULT_PROMPTS
