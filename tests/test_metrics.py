"""The Prometheus counters: the orchestrator's (`/metrics`) agree with the per-request stats its
answers carry, and each model service exports its calls, sessions, queue and batches."""

import re

from test_openai_api import PROMPT, client, delta, grpc_generate, http, scrape

from specd.proto.metrics import start_exporter


async def test_metrics_agree_with_the_per_request_stats(tiny_stack, tiny_http):
    stack, (base, model) = tiny_stack, tiny_http
    before = scrape((await http("GET", f"{base}/metrics"))[1])
    openai_client = client(base)
    stats = []
    for k, prompt in ((4, PROMPT), (2, "The capital of France is"), (6, "import numpy as np\n")):
        completion = await openai_client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=14,
            temperature=0,
            extra_body={"ignore_eos": True, "specd": {"draft_tokens": k}},
        )
        stats.append(completion.model_extra["specd"])
    _, final = await grpc_generate(stack, 9, k=3, prompt=PROMPT)
    assert (await http("POST", f"{base}/v1/completions", {"prompt": PROMPT, "n": 0}))[0] == 400  # refused by parse
    assert (await http("POST", f"{base}/v1/completions", {"prompt": ""}))[0] == 400  # refused by the core
    after = scrape((await http("GET", f"{base}/metrics"))[1])

    accepted = sum(s["accepted"] for s in stats) + final.stats.accepted
    assert delta(after, before, "specd_spec_decode_num_accepted_tokens_total") == accepted > 0
    assert (
        delta(after, before, "specd_spec_decode_num_draft_tokens_total")
        == sum(s["drafted"] for s in stats) + final.stats.drafted
    )
    drafts = delta(after, before, "specd_spec_decode_num_drafts_total")
    assert drafts == sum(s["drafting_steps"] for s in stats) + final.stats.drafting_steps > 0
    per_position = [0] * 6
    for accepted_per_position in [s["accepted_per_position"] for s in stats] + [final.stats.accepted_per_position]:
        for position, count in enumerate(accepted_per_position):
            per_position[position] += count
    for position, count in enumerate(per_position):
        name = f'specd_spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}}'
        assert delta(after, before, name) == count, position
    assert delta(after, before, 'specd_requests_total{api="http",outcome="length"}') == 3
    assert delta(after, before, 'specd_requests_total{api="grpc",outcome="length"}') == 1
    assert delta(after, before, 'specd_requests_total{api="http",outcome="INVALID_ARGUMENT"}') == 2
    assert delta(after, before, "specd_e2e_request_latency_seconds_count") == 4
    assert delta(after, before, "specd_time_to_first_token_seconds_count") == 4
    assert delta(after, before, "specd_generation_tokens_total") == 3 * 14 + 9
    steps = sum(s["steps"] for s in stats) + final.stats.steps
    assert delta(after, before, 'specd_step_seconds_count{phase="verify"}') == steps
    assert delta(after, before, 'specd_step_seconds_count{phase="network"}') == steps
    assert after["specd_requests_running"] == 0


async def test_services_export_calls_sessions_and_batches(tiny_stack):
    stack = tiny_stack
    await grpc_generate(stack, 6, prompt=PROMPT)
    for server, method in ((stack.services.draft_server, "Propose"), (stack.services.target_server, "Verify")):
        exporter = start_exporter(server.metrics.registry, "127.0.0.1", 0)
        try:
            status, text = await http("GET", f"http://127.0.0.1:{exporter.server_port}/metrics")
        finally:
            exporter.shutdown()
        samples = scrape(text)
        assert status == 200
        assert samples[f'specd_service_calls_total{{code="OK",method="{method}"}}'] > 0
        assert samples[f'specd_service_call_seconds_count{{method="{method}"}}'] > 0
        assert "specd_sessions_open" in samples and "specd_queue_depth" in samples
        assert re.search(r'specd_batch_size_bucket\{le="\+Inf"\}', text)
