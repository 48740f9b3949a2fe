"""The peer benchmark (`specd bench`): short runs on the tiny stack, its prompts, its HF baselines and
peers (its maths on hand numbers: tests/test_bench_report.py)."""

import argparse
import asyncio
import io
import json

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


@pytest.mark.serial  # a busy machine lets every Propose miss its deadline: nothing drafted, no c
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
    assert (settings.draft.engine, settings.target.engine) == ("llama.cpp", "transformers")  # specd's services'
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
