"""The multi-turn chat workload of `specd loadtest --chat` (bench/chat.py): the shipped conversations,
the prompts of each turn, the per-turn figures on hand-built timings, a run against a fake OpenAI-
compatible server that keeps a prefix cache, and a short run on the tiny stack over gRPC and HTTP."""

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specd.bench import chat, chat_report, loadtest, openai_client
from specd.bench.workload import RequestResult, Settings
from specd.cli import loadtest as loadtest_cli
from specd.cli.common import UserError
from specd.model.prefix_cache import BLOCK_TOKENS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specd")
    loadtest_cli.add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


# ---------------------------------------------------------------- the conversations and their prompts


def test_the_shipped_conversations_are_16_of_6_distinct_human_turns():
    conversations = chat.load_conversations()
    assert len(conversations) >= 16 and all(len(c.turns) >= 6 for c in conversations)
    messages = [message for c in conversations for message in c.turns]
    assert len(set(messages)) == len(messages)  # no two alike: nothing is cached across conversations
    assert len({c.id for c in conversations}) == len(conversations)
    assert all(90 <= len(message.split()) <= 160 for message in messages)  # ~150 tokens each
    assert all(c.system == chat.DEFAULT_SYSTEM for c in conversations)
    with chat.DEFAULT_CHAT.open() as lines:  # ShareGPT's shape
        record = json.loads(next(lines))
    assert {m["from"] for m in record["conversations"]} == {"system", "human"}


def test_a_conversations_file_is_read_or_refused_with_its_line(tmp_path):
    path = tmp_path / "c.jsonl"
    conversation = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"},
                                                  {"from": "user", "value": "and?"}]}  # fmt: skip
    path.write_text(
        json.dumps(conversation) + "\n\n" + json.dumps({"conversations": [{"from": "human", "value": "b"}]})
    )
    first, second = chat.load_conversations(path)
    assert first == chat.Conversation("a", chat.DEFAULT_SYSTEM, ("hi", "and?"))  # the gpt turn is not sent
    assert second.id == "1" and second.turns == ("b",)
    with pytest.raises(chat.ChatError, match="have fewer human turns"):
        chat.pick_conversations([first, second], 2, 2)
    with pytest.raises(chat.ChatError, match="3 conversations asked for, the file holds 2"):
        chat.pick_conversations([first, second], 3, 1)
    assert chat.pick_conversations([first, second], 1, 2) == [first]
    for text, message in (
        ("{", "c.jsonl:1: expected"),
        ('{"conversations": [{"from": "gpt", "value": "x"}]}', "no human turn"),
        ('{"conversations": [{"from": "human", "value": ""}]}', "non-empty"),
    ):
        path.write_text(text)
        with pytest.raises(chat.ChatError, match=message):
            chat.load_conversations(path)
    with pytest.raises(chat.ChatError, match="not found"):
        chat.load_conversations(tmp_path / "nope.jsonl")


def test_a_prompt_is_the_history_in_the_qwen_chat_format():
    assert chat.render_prompt("S", [("h1", "a1")], "h2") == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nh1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nh2<|im_end|>\n<|im_start|>assistant\n"
    )


class FakeTarget:
    """An in-process target: answers `answer-<conversation's first words>-<turn>`, after `delay` seconds."""

    backend, speculation, info = "fake", False, None

    def __init__(self, name="fake", fail=None):
        self.name, self.fail, self.prompts = name, fail, []

    async def open(self, timeout):
        pass

    async def close(self):
        pass

    async def send(self, settings: Settings, index: int) -> RequestResult:
        (prompt,) = settings.prompts
        self.prompts.append(prompt)
        result = RequestResult(started=0.0, ended=1.0, delta_times=[0.25, 1.0], delta_tokens=[1, 1])
        turn = prompt.count("<|im_start|>user")
        result.text = f"answer-{prompt.split()[6] if turn else 'warm'}-{turn}"
        result.completion_tokens, result.prompt_tokens = 2, len(prompt.split())
        if self.fail and self.fail in prompt:
            result.error = "UNAVAILABLE"
        return result

    def describe(self):
        return {"name": self.name, "backend": self.backend}


async def test_turn_t_sends_every_earlier_human_message_and_the_answer_given():
    conversation = chat.load_conversations()[3]
    target = FakeTarget()
    done = await chat.converse(target, Settings("", []), conversation, 0, 6)
    assert [t.turn for t in done] == [1, 2, 3, 4, 5, 6] and all(t.result.ok for t in done)
    for number, prompt in enumerate(target.prompts, 1):
        assert prompt.startswith(f"<|im_start|>system\n{conversation.system}<|im_end|>\n")
        assert prompt.endswith(f"<|im_start|>user\n{conversation.turns[number - 1]}<|im_end|>\n<|im_start|>assistant\n")
        position = 0
        for earlier in range(number - 1):  # in order: the message, then the answer the target gave
            position = prompt.index(conversation.turns[earlier], position)
            position = prompt.index(f"assistant\n{done[earlier].result.text}<|im_end|>", position)
        if number > 1:
            assert prompt.startswith(target.prompts[number - 2])  # what a prefix cache can reuse
    assert len({t.result.text for t in done}) == 6


async def test_a_failed_turn_ends_its_conversation_and_the_rest_run():
    conversations = chat.load_conversations()[:3]
    target = FakeTarget(fail=conversations[1].turns[1])  # conversation 1 fails at turn 2
    report = await chat.run_chat(Settings("", []), conversations, 4, 2, [target], warmup=1)
    (run,) = report["runs"]
    assert run["requests"] == 10 and run["not_sent"] == 2 and run["completed"] == 9
    assert run["errors"] == {"UNAVAILABLE": 1}
    assert [turn["requests"] for turn in run["per_turn"]] == [3, 3, 2, 2]
    assert run["per_turn"][1]["errors"] == {"UNAVAILABLE": 1} and run["per_turn"][1]["completed"] == 2
    assert run["outputs"][1] == {"id": conversations[1].id, "turns": [run["outputs"][1]["turns"][0], None, None, None]}
    assert len(target.prompts) == 1 + 10  # a warm-up request, then the turns sent
    assert report["outputs_match"] == []


# ---------------------------------------------------------------- figures on known timings


def result(ttft: float, e2e: float, tokens: int, prompt: int | None, cached: int | None, error=None):
    """A request that started at 10 s, its first token after `ttft` and its last after `e2e`."""
    return RequestResult(
        started=10.0,
        ended=10.0 + e2e,
        delta_times=[10.0 + ttft, 10.0 + e2e],
        delta_tokens=[1, 1],
        completion_tokens=tokens,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        error=error,
    )


def test_per_turn_figures_from_known_timings():
    results = [result(0.1, 1.0, 8, 100, 0), result(0.3, 2.0, 8, 200, 150), result(0.2, 1.0, 4, 100, None),
               result(0.9, 3.0, 8, 100, 0, error="UNAVAILABLE")]  # fmt: skip
    figures = chat.turn_figures(results)
    assert figures["requests"] == 4 and figures["completed"] == 3 and figures["errors"] == {"UNAVAILABLE": 1}
    assert figures["ttft_s"]["p50"] == pytest.approx(0.2) and figures["ttft_s"]["p90"] == pytest.approx(0.28)
    assert figures["ttft_s"]["mean"] == pytest.approx(0.2) and figures["e2e_s"]["p50"] == pytest.approx(1.0)
    assert figures["stream_tokens_per_s"] == pytest.approx(20 / 4.0) and figures["output_tokens"] == 20
    assert figures["prompt_tokens"] == 400 and figures["prompt_tokens_mean"] == pytest.approx(400 / 3)
    assert figures["cached_prompt_tokens"] == 150 and figures["cache_reported"] == 2
    assert figures["cache_hit_rate"] == pytest.approx(150 / 300)  # over the requests that said how many
    unknown = chat.turn_figures([result(0.1, 1.0, 8, 100, None)])
    assert unknown["cached_prompt_tokens"] is None and unknown["cache_hit_rate"] is None
    assert chat.turn_figures([])["ttft_s"]["p50"] is None


def test_a_targets_figures_per_turn_and_over_turns_2_to_t():
    conversations = [chat.Conversation("a", "s", ("1", "2", "3")), chat.Conversation("b", "s", ("1", "2", "3"))]
    timings = {1: (1.0, 100, 0), 2: (0.2, 300, 240), 3: (0.4, 500, 440)}  # turn: TTFT, prompt, cached
    done = []
    for conversation in (0, 1):
        for turn, (ttft, prompt, cached) in timings.items():
            r = result(ttft + conversation * 0.1, 2.0, 8, prompt, cached)
            r.text = f"{conversation}.{turn}"
            done.append(chat.Turn(conversation, turn, r))
    run = chat.summarize_chat(done, 10.0, conversations, 3, 2, speculation=False)
    assert [turn["ttft_s"]["p50"] for turn in run["per_turn"]] == pytest.approx([1.05, 0.25, 0.45])
    assert [turn["cache_hit_rate"] for turn in run["per_turn"]] == pytest.approx([0.0, 0.8, 0.88])
    assert run["cache_hit_rate"] == run["later_turns"]["cache_hit_rate"] == pytest.approx(1360 / 1600)
    assert run["later_turns"]["ttft_s"]["p50"] == pytest.approx(0.35) and run["later_turns"]["requests"] == 4
    assert run["output_tokens"] == 48 and run["output_tokens_per_s"] == pytest.approx(4.8)
    assert run["outputs"] == [{"id": "a", "turns": ["0.1", "0.2", "0.3"]}, {"id": "b", "turns": ["1.1", "1.2", "1.3"]}]
    assert run["per_request"][4] == {"conversation": "b", "turn": 2, "ttft_s": pytest.approx(0.3), "e2e_s": 2.0,
                                     "prompt_tokens": 300, "cached_prompt_tokens": 240, "completion_tokens": 8,
                                     "error": None}  # fmt: skip
    other = json.loads(json.dumps(run))
    other["outputs"][1]["turns"][2] = "different"
    matches = chat.outputs_match([{**run, "target": "on"}, {**run, "target": "same"}, {**other, "target": "off"}])
    assert matches[0] == {"target": "same", "reference": "on", "turns_compared": 6, "turns_equal": 6,
                          "identical": True, "first_difference": None}  # fmt: skip
    assert matches[1]["turns_equal"] == 5 and matches[1]["first_difference"] == {"conversation": "b", "turn": 3}


# ---------------------------------------------------------------- a fake OpenAI-compatible server


class FakeServer(ThreadingHTTPServer):
    """/v1/models and streamed /v1/completions with a prefix cache of whole prompts: a request's cached
    tokens (words) are the longest earlier prompt it starts with. `report`: "usage" says it as
    usage.prompt_tokens_details.cached_tokens, "timings" as llama-server's timings.cache_n, "none" not at all."""

    daemon_threads = True

    def __init__(self, report: str):
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.report, self.seen, self.lock = report, [], threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class FakeHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps(
            {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": "t"}]}
        )
        self._send(body.encode(), "application/json")

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, words = request["prompt"], request["prompt"].split()
        with self.server.lock:
            cached = max((len(p.split()) for p in self.server.seen if prompt.startswith(p)), default=0)
            self.server.seen.append(prompt)
        pieces = [f" r{len(words)}.{i}" for i in range(request["max_tokens"])]
        usage = {
            "prompt_tokens": len(words),
            "completion_tokens": len(pieces),
            "total_tokens": len(words) + len(pieces),
        }
        final = {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}], "usage": usage}
        if self.server.report == "usage":
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        elif self.server.report == "timings":
            final["timings"] = {"cache_n": cached, "prompt_n": len(words) - cached}
        chunks = [
            {"choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}]} for piece in pieces
        ]
        lines = [{"id": "c", "object": "text_completion", "created": 0, "model": "fake", **c} for c in chunks + [final]]
        body = "".join(f"data: {json.dumps(line)}\n\n" for line in lines) + "data: [DONE]\n\n"
        self._send(body.encode(), "text/event-stream")

    def _send(self, body: bytes, kind: str):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(params=["usage", "timings"])
def fake_server(request):
    server = FakeServer(request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_chat_run_against_an_openai_server_reports_its_cache_per_turn(fake_server, tmp_path, capsys):
    out = tmp_path / "chat.json"
    argv = ["loadtest", "--openai", f"fake={fake_server.url}", "--chat", "--conversations", "3", "--turns", "4",
            "--concurrency", "2", "--max-new-tokens", "5", "--warmup", "1", "--json", str(out),
            "--plot", str(tmp_path / "chat.png")]  # fmt: skip
    assert cli(argv) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["target"] == "fake" and run["backend"] == "openai" and run["completed"] == 12 and run["errors"] == {}
    sent = [p for p in fake_server.seen if p != chat.WARMUP_PROMPT]
    conversations = chat.load_conversations()[:3]
    by_turn = {}  # turn -> [(prompt words, cached words)] from what the server received
    for conversation in conversations:
        prompts = [p for p in sent if conversation.turns[0] in p]
        assert len(prompts) == 4 and all(b.startswith(a) for a, b in zip(prompts, prompts[1:]))
        for number, prompt in enumerate(prompts, 1):
            cached = len(prompts[number - 2].split()) if number > 1 else 0
            by_turn.setdefault(number, []).append((len(prompt.split()), cached))
            if number < 4:  # the answer the server gave is in the next turn's prompt
                answer = run["outputs"][conversations.index(conversation)]["turns"][number - 1]
                assert answer == "".join(f" r{len(prompt.split())}.{i}" for i in range(5))
                assert f"assistant\n{answer}<|im_end|>" in prompts[number]
    for turn in run["per_turn"]:
        expected = by_turn[turn["turn"]]
        assert turn["completed"] == 3 and turn["output_tokens"] == 15
        assert turn["prompt_tokens"] == sum(words for words, _ in expected)
        assert turn["cached_prompt_tokens"] == sum(cached for _, cached in expected) and turn["cache_reported"] == 3
        assert turn["cache_hit_rate"] == pytest.approx(turn["cached_prompt_tokens"] / turn["prompt_tokens"])
        assert turn["ttft_s"]["p50"] > 0 and turn["stream_tokens_per_s"] > 0
    assert run["per_turn"][0]["cached_prompt_tokens"] == 0
    later = [pair for number in (2, 3, 4) for pair in by_turn[number]]
    assert run["cache_hit_rate"] == pytest.approx(sum(c for _, c in later) / sum(w for w, _ in later))
    assert [o["id"] for o in run["outputs"]] == [c.id for c in conversations]
    settings = report["settings"]
    assert (settings["conversations"], settings["turns"], settings["concurrency"]) == (3, 4, 2)
    assert settings["chat_file"] == str(chat.DEFAULT_CHAT) and settings["max_new_tokens"] == 5
    assert settings["targets"][0]["model"] == "fake" and report["workload"] == "chat"
    assert (tmp_path / "chat.png").read_bytes().startswith(PNG_SIGNATURE)
    err = capsys.readouterr().err
    assert "chat C=2 (12/12 done" in err  # progress lines off a terminal
    assert "TTFT p50/p90 turns 2–4 ms" in err and "per turn number" in err


def test_the_same_server_twice_matches_its_outputs_and_a_cacheless_one_says_unknown(tmp_path):
    servers = [FakeServer("usage"), FakeServer("none")]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "two.json"
        argv = ["loadtest", "--openai", f"on={servers[0].url}", "--openai", f"off={servers[1].url}", "--chat",
                str(chat.DEFAULT_CHAT), "--conversations", "2", "--turns", "3", "--concurrency", "2",
                "--max-new-tokens", "3", "--warmup", "0", "--json", str(out)]  # fmt: skip
        assert cli(argv) == 0
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    report = json.loads(out.read_text())
    on, off = report["runs"]
    assert (on["target"], off["target"]) == ("on", "off")
    assert on["cache_hit_rate"] > 0.5 and off["cache_hit_rate"] is None
    assert all(turn["cached_prompt_tokens"] is None for turn in off["per_turn"])
    assert report["outputs_match"] == [{"target": "off", "reference": "on", "turns_compared": 6, "turns_equal": 6,
                                        "identical": True, "first_difference": None}]  # fmt: skip
    assert chat_report.chat_turn_table(report).row_count == 6 and chat_report.chat_summary_table(report).row_count == 2


def test_cached_tokens_are_read_from_usage_else_timings():
    from openai.types import CompletionUsage

    usage = CompletionUsage.model_validate(
        {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 7}}
    )
    assert openai_client.cached_tokens(usage, {"cache_n": 3}) == 7
    bare = CompletionUsage(prompt_tokens=9, completion_tokens=1, total_tokens=10)
    assert openai_client.cached_tokens(bare, {"cache_n": 3}) == 3
    assert openai_client.cached_tokens(bare, None) is None and openai_client.cached_tokens(None, None) is None


def test_cached_tokens_of_a_grpc_final_where_the_proto_has_the_field():
    from specd.bench.grpc_target import cached_prompt_tokens
    from specd.v1 import specdecode_pb2

    final = specdecode_pb2.Final()
    fields = [m for m in (final.stats, final.usage, final) if "cached_prompt_tokens" in m.DESCRIPTOR.fields_by_name]
    if not fields:  # a proto from before the prefix cache: unknown
        assert cached_prompt_tokens(final) is None
        return
    fields[0].cached_prompt_tokens = 42
    assert cached_prompt_tokens(final) == 42


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--chat", "--rate", "2"], "--rate does not apply to --chat"),
        (["--chat", "--compare"], "--compare does not apply to --chat"),
        (["--chat", "--requests", "4"], "--requests does not apply to --chat"),
        (["--chat", "--prompts", "x.jsonl"], "--prompts does not apply to --chat"),
        (["--chat", "--concurrency", "1,4"], "one --concurrency level"),
        (["--turns", "3"], "--turns goes with --chat"),
        (["--conversations", "3"], "--conversations goes with --chat"),
    ],
)
def test_command_line_refuses_flags_that_do_not_go_with_chat(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["loadtest", "--server", "127.0.0.1:1", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_command_line_says_when_the_file_has_too_few_conversations_or_turns(tmp_path):
    with pytest.raises(UserError, match="17 conversations asked for, the file holds 16"):
        cli(["loadtest", "--server", "127.0.0.1:1", "--chat", "--conversations", "17"])
    with pytest.raises(UserError, match="7 turns asked for"):
        cli(["loadtest", "--server", "127.0.0.1:1", "--chat", "--turns", "7"])
    with pytest.raises(UserError, match="not found"):
        cli(["loadtest", "--server", "127.0.0.1:1", "--chat", str(tmp_path / "none.jsonl")])


# ---------------------------------------------------------------- the tiny stack, over gRPC and HTTP


async def test_chat_on_the_tiny_stack_gives_grpc_and_http_the_same_text_every_turn(tiny_stack, tiny_http, tmp_path):
    url, _ = tiny_http
    targets = [loadtest.GrpcTarget(f"127.0.0.1:{tiny_stack.orchestrator.port}"), openai_client.OpenAiTarget(url)]
    settings = Settings("", [], max_new_tokens=4, draft_tokens=2, timeout=60.0)
    conversations = chat.load_conversations()[:2]
    report = await chat.run_chat(settings, conversations, 2, 2, targets, warmup=1)
    report = json.loads(json.dumps(report))  # the report is plain JSON
    grpc_run, http_run = report["runs"]
    for run in (grpc_run, http_run):
        assert run["errors"] == {} and run["completed"] == 4 and run["output_tokens"] == 16
        assert [turn["completed"] for turn in run["per_turn"]] == [2, 2]
        assert run["per_turn"][1]["prompt_tokens_mean"] > run["per_turn"][0]["prompt_tokens_mean"] > 150
        cached = [turn["cached_prompt_tokens"] for turn in run["per_turn"]]
        assert all(isinstance(value, int) and value >= 0 for value in cached)  # the server said, every turn
        # Turn 2 opens with turn 1's prompt (over 150 tokens): its whole blocks come from the target's
        # prefix cache, two at least, for each of the two conversations.
        assert cached[1] >= 2 * 2 * BLOCK_TOKENS
    assert grpc_run["acceptance_rate"] is not None and "acceptance_rate" not in http_run
    assert report["outputs_match"][0]["identical"] and report["outputs_match"][0]["turns_compared"] == 4
    assert report["settings"]["server_info"]["workers"] == 2
    chat_report.save_chat_plot(report, tmp_path / "tiny.png")
    assert (tmp_path / "tiny.png").read_bytes().startswith(PNG_SIGNATURE)


async def test_the_same_short_prompt_twice_takes_all_of_it_but_its_last_token_from_the_store(tiny_stack, tiny_http):
    """Issue 49, short prompts: a prompt under one block, sent again over gRPC and over HTTP, reports
    every prompt token but its last as cached (the first send: none), and its greedy text is the same."""
    url, _ = tiny_http
    for number, target in enumerate(
        [loadtest.GrpcTarget(f"127.0.0.1:{tiny_stack.orchestrator.port}"), openai_client.OpenAiTarget(url)]
    ):
        prompt = f"# short prompt {number}, sent twice by test_loadtest_chat\ndef twice_{number}():"
        settings = Settings("", [prompt], max_new_tokens=6, draft_tokens=2, timeout=60.0)
        await target.open(60.0)
        try:
            first, second = [await target.send(settings, 0) for _ in range(2)]
        finally:
            await target.close()
        assert first.ok and second.ok and 1 < second.prompt_tokens < BLOCK_TOKENS
        assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, second.prompt_tokens - 1)
        assert first.text == second.text and first.completion_tokens == second.completion_tokens == 6
