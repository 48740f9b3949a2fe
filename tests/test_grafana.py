"""deploy/grafana: the dashboard is Grafana's JSON model, every panel queries Prometheus, and every
metric it queries is one a running stack exports; the Prometheus example scrapes the default ports."""

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from specd.cli.serve import DEFAULT_METRICS_PORTS
from specd.proto.metrics import start_exporter
from specd.v1 import common_pb2, specdecode_pb2

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
METRIC = re.compile(r"\bspecd_[a-z0-9_]+")
# What the dashboard is for (issue 19): a query for each of these.
TOPICS = {
    "throughput": "rate(specd_generation_tokens_total",
    "TTFT percentiles": "histogram_quantile(0.99, sum by (le) (rate(specd_time_to_first_token_seconds_bucket",
    "TPOT percentiles": "histogram_quantile(0.99, sum by (le) (rate(specd_time_per_output_token_seconds_bucket",
    "acceptance by position": "sum by (position) (rate(specd_spec_decode_num_accepted_tokens_per_pos_total",
    "K over time": "rate(specd_spec_decode_num_draft_tokens_total",
    "draft/verify/network split": "sum by (phase) (rate(specd_step_seconds_sum",
    "queue depth": "specd_queue_depth",
    "batch sizes": "rate(specd_batch_size_bucket",
    "sessions": "specd_sessions_open",
    "prefix cache hit rate": "rate(specd_prefix_cache_miss_tokens_total",
    "prefix cache bytes": "specd_prefix_cache_bytes",
}


def dashboard() -> dict:
    return json.loads((GRAFANA / "specd.json").read_text())


def queries(board: dict) -> list[str]:
    return [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]


def test_the_dashboard_is_grafana_json_whose_panels_each_query_prometheus():
    board = dashboard()
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    (variable,) = board["templating"]["list"]  # the Prometheus data source, chosen on import
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    panels = [panel for panel in board["panels"] if panel["type"] != "row"]
    assert len(panels) >= 12
    for panel in panels:
        assert panel["title"] and panel["description"] and panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert METRIC.search(expr), (panel["title"], expr)
            for opening, closing in ("()", "[]", "{}"):
                assert expr.count(opening) == expr.count(closing), (panel["title"], expr)
    everything = "\n".join(queries(board))
    missing = [topic for topic, query in TOPICS.items() if query not in everything]
    assert missing == []


async def test_every_metric_the_dashboard_queries_is_in_a_running_stacks_metrics(tiny_stack):
    # A speculative request, so that the labelled series (per phase, per position, per method) exist.
    request = specdecode_pb2.GenerateRequest(
        prompt="def quicksort(arr):",
        max_new_tokens=8,
        draft_tokens=3,
        drafter="model",
        ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0),
    )
    async for _ in tiny_stack.client.Generate(request):
        pass
    services = tiny_stack.services
    registries = [tiny_stack.orchestrator.metrics.registry, services.draft_server.metrics.registry]
    registries.append(services.target_server.metrics.registry)
    exported = set()
    for registry in registries:
        exporter = start_exporter(registry, "127.0.0.1", 0)  # what each `specd serve` serves on --metrics-port
        try:
            text = await asyncio.to_thread(scrape, f"http://127.0.0.1:{exporter.server_port}/metrics")
        finally:
            exporter.shutdown()
        exported |= {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    queried = set(METRIC.findall("\n".join(queries(dashboard()))))
    assert len(queried) >= 15
    assert queried - exported == set()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def test_the_prometheus_example_scrapes_the_three_default_metrics_ports():
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: [target for static in job["static_configs"] for target in static["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets == {f"specd-{role}": [f"localhost:{port}"] for role, port in DEFAULT_METRICS_PORTS.items()}


def test_the_readme_points_to_the_dashboard_and_the_scrape_config():
    readme = (ROOT / "README.md").read_text()
    assert "deploy/grafana/specd.json" in readme and "deploy/grafana/prometheus.yml" in readme
