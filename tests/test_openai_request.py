"""The OpenAI-compatible HTTP API's requests (orchestrator/openai_request.py): the served model and
health, OpenAI-style 400s naming what specd does not do or what a value must be, bodies that do not
parse, defaults and nulls accepted, a developer message read as a system message. The answers
themselves, streaming, metrics and TLS are tests/test_openai_api.py's."""

import json

import pytest
from test_openai_api import CHAT, PROMPT, client, http


async def test_models_health_and_wrong_model(tiny_http):
    base, model = tiny_http
    status, body = await http("GET", f"{base}/v1/models")
    assert status == 200 and [entry["id"] for entry in json.loads(body)["data"]] == [model]
    assert await http("GET", f"{base}/health") == (200, '{"status":"ok"}')
    status, body = await http("POST", f"{base}/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "path, fields, param, fragment",
    [
        ("completions", {"n": 0}, "n", "integer >= 1"),
        ("completions", {"specd": {"draft_ahead": "maybe"}}, "specd.draft_ahead", "one of auto, on, off"),
        ("completions", {"specd": {"drafter": "oracle"}}, "specd.drafter", "one of hybrid, model, ngram, suffix"),
        ("completions", {"n": 100}, "n", "at most 16"),
        ("completions", {"n": 9, "prompt": ["a", "b"]}, "n", "x 2 prompts asks for 18 choices"),
        ("completions", {"best_of": 3}, "best_of", "choices it returns"),
        ("completions", {"echo": "yes"}, "echo", "true or false"),
        ("completions", {"logprobs": 6}, "logprobs", "0..5"),
        ("completions", {"logprobs": True}, "logprobs", "0..5"),
        ("completions", {"top_logprobs": 2}, "top_logprobs", "unknown field"),
        ("completions", {"suffix": "}"}, "suffix", "suffix"),
        ("completions", {"logit_bias": {"42": 500}}, "logit_bias", "[-100, 100]"),  # served: tests/test_penalties.py
        ("completions", {"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ("completions", {"guided_json": {}}, "guided_json", "unknown field"),
        ("completions", {"temperature": -1}, "temperature", ">= 0"),
        ("completions", {"temperature": "hot"}, "temperature", "finite number"),
        ("completions", {"top_p": 0}, "top_p", "(0, 1]"),
        ("completions", {"max_tokens": 0}, "max_tokens", ">= 1"),
        ("completions", {"seed": -1}, "seed", "seed"),
        ("completions", {"stop": 5}, "stop", "stop"),
        ("completions", {"prompt": ["one", 5]}, "prompt", "a list of those"),
        ("completions", {"prompt": ["ok", [5, 2**32]]}, "prompt", "prompt[1] token id"),
        ("completions", {"prompt": ""}, None, "empty"),
        ("completions", {"max_tokens": 100_000}, "max_tokens", "exceeds the 4096 tokens"),
        ("completions", {"max_tokens": 10**20}, "max_tokens", "exceeds the 4096 tokens"),  # beyond a uint32
        ("completions", {"max_tokens": 4000, "prompt": [13] * 200}, None, "exceeds"),  # prompt + output: the core
        ("completions", {"specd": {"draft_tokens": 99}}, "specd.draft_tokens", "K=99"),
        ("completions", {"specd": {"draft_tokens": 2**40}}, "specd.draft_tokens", "above the largest"),
        ("completions", {"specd": {"k": 2}}, "specd.k", "draft_tokens"),
        ("completions", {"specd": {"trace": "yes"}}, "specd.trace", "true or false"),
        ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        (
            "completions",
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options",
            "true or false",
        ),
        # Lone surrogates: valid JSON ("\ud800"), but no Unicode, so no UTF-8 for the tokenizer (was a 500).
        (
            "completions",
            {"prompt": "\ud800"},
            "prompt",
            "`prompt` is not valid Unicode: it holds a lone surrogate at index 0",
        ),
        ("completions", {"prompt": "ok\udfff"}, "prompt", "lone surrogate at index 2"),
        ("completions", {"stop": ["end", "\ud800"]}, "stop[1]", "not valid Unicode"),
        ("completions", {"user": "\udc00"}, "user", "not valid Unicode"),
        ("completions", {"model": "\ud800"}, "model", "not valid Unicode"),
        ("completions", {"\ud800": 1}, "\\ud800", "the field name `\\ud800` is not valid Unicode"),
        # Values no uint32 or float32 of the GenerateRequest could carry (were 500s).
        ("completions", {"prompt": [5, 2**32]}, "prompt", "outside the vocabulary"),
        ("completions", {"top_k": 2**32}, "top_k", "[-1, 2^32)"),
        ("completions", {"temperature": 1e39}, "temperature", "float32"),
        ("completions", {"model": 5}, "model", "must be a string"),
        ("completions", {"user": ["me"]}, "user", "must be a string"),
        ("completions", {"cache_salt": "s" * 257}, "cache_salt", "cache_salt must be at most 256 characters"),
        ("chat/completions", {"cache_salt": 7}, "cache_salt", "must be a string"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
        ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format", "structured"),
        ("chat/completions", {"n": 17}, "n", "at most 16"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs `logprobs: true`"),
        ("chat/completions", {"logprobs": 3}, "logprobs", "true or false"),
        ("chat/completions", {"echo": True}, "echo", "unknown field"),
        ("chat/completions", {"messages": []}, "messages", "non-empty"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content",
            "`messages[0].content` is not valid Unicode: it holds a lone surrogate at index 0",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]},
            "messages[0].content[0].text",
            "lone surrogate at index 1",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages[0].role",
            '`messages[0].role` = "wizard" is not a chat role: use system, user, assistant, developer',
        ),
        ("chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, "messages[0].role", "no tool calls"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi", "name": 7}]},
            "messages[0].name",
            "string",
        ),
        ("chat/completions", {"max_completion_tokens": 2, "max_tokens": "many"}, "max_tokens", "integer >= 1"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "no images",
        ),
    ],
)
async def test_unsupported_fields_and_bad_values_answer_400(tiny_http, path, fields, param, fragment):
    base, model = tiny_http
    body = {"model": model, "max_tokens": 4}
    body.update({"messages": CHAT} if path.startswith("chat") else {"prompt": PROMPT})
    body.update(fields)
    status, text = await http("POST", f"{base}/v1/{path}", body)
    error = json.loads(text)["error"]
    assert status == 400, text
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"], error["message"]


async def test_defaults_and_nulls_are_accepted(tiny_http):
    base, model = tiny_http
    status, text = await http(
        "POST",
        f"{base}/v1/completions",
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 3,
            "n": 1,
            "logprobs": None,
            "echo": False,
            "presence_penalty": 0,
            "logit_bias": {},
            "user": "someone",
            "stop": None,
        },
    )
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] <= 3
    status, text = await http("POST", f"{base}/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(text)["error"]["message"]


@pytest.mark.parametrize(
    "body, says",
    [
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),  # deeper than the parser recurses (was a 500)
        (b'{"prompt": "\xed\xa0\x80"}', "lone surrogate"),  # a surrogate's would-be UTF-8 bytes
        ('{"prompt": "\ud800"}'.encode("utf-16-le", "surrogatepass"), "lone surrogate"),  # UTF-16, as JSON may be
        (b"\xff\xfe\xfd", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"null", "must be a JSON object"),
    ],
)
async def test_bodies_that_do_not_parse_into_a_request_answer_400(tiny_http, body, says):
    base, _ = tiny_http
    for path in ("completions", "chat/completions"):
        status, text = await http("POST", f"{base}/v1/{path}", body)
        assert status == 400 and says in json.loads(text)["error"]["message"], text


async def test_a_developer_message_is_a_system_message(tiny_http):
    """The target's template knows no `developer` role (it would drop the message): it is rendered as `system`."""
    base, model = tiny_http
    answers = []
    for role in ("developer", "system"):
        completion = await client(base).chat.completions.create(
            model=model, messages=[{"role": role, "content": "Be terse."}, CHAT[1]], max_tokens=4, temperature=0
        )
        answers.append((completion.choices[0].message.content, completion.usage.prompt_tokens))
    assert answers[0] == answers[1]
