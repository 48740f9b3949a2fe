"""The orchestrator's Prometheus metrics: requests, latencies, tokens and speculation counters.

Generation loops run in Ray actors (other processes), so nothing here is updated from inside
a loop: `track` wraps the event stream a request gets back, in the server process, and
records the request from its own clock (TTFT, TPOT, end to end, as the client sees them) and
from the per-request Stats that arrive with the Finished event (speculation counters with
vLLM's definitions, per-step draft / verify / network seconds). gRPC and HTTP requests go
through the same `track`, labelled by `api`.
"""

import time
from collections.abc import AsyncGenerator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specd.orchestrator.request import Delta, Failed, Finished
from specd.orchestrator.router import Route
from specd.proto.metrics import LATENCY_BUCKETS

TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class OrchestratorMetrics:
    def __init__(self):
        registry = self.registry = CollectorRegistry()
        self.requests = Counter(
            "specd_requests",
            "Requests ended, by API (grpc, http) and outcome (a finish reason: length, stop; or a "
            "status code: INVALID_ARGUMENT, UNAVAILABLE, ...; or cancelled)",
            ["api", "outcome"],
            registry=registry,
        )
        self.running = Gauge("specd_requests_running", "Requests being generated now", registry=registry)
        self.routes = Counter(
            "specd_routes",
            "New requests placed on a replica of a pool, by role (target, draft) and reason (affinity: the "
            "replica sent the longest prefix of the prompt; load: the least loaded; imbalance: the least loaded "
            "of an imbalanced pool; round-robin)",
            ["role", "reason"],
            registry=registry,
        )
        self.migrations = Counter(
            "specd_migrations",
            "Requests moved to another replica after theirs failed, by role (migration.py; a draft's: generation.py)",
            ["role"],
            registry=registry,
        )
        self.route_matched_tokens = Counter(
            "specd_route_matched_tokens",
            "Prompt tokens the chosen replica was sent before, by role (what its prefix cache likely holds)",
            ["role"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "specd_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first output token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "specd_time_per_output_token_seconds",
            "Per request: (end to end - TTFT) / (output tokens - 1)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "specd_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter("specd_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.cached_prompt_tokens = Counter(
            "specd_cached_prompt_tokens",
            "Of specd_prompt_tokens, those the target took from its prefix cache",
            registry=registry,
        )
        self.generation_tokens = Counter(
            "specd_generation_tokens", "Output tokens of finished requests", registry=registry
        )
        self.request_generation_tokens = Histogram(
            "specd_request_generation_tokens",
            "Output tokens per finished request",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.num_drafts = Counter(
            "specd_spec_decode_num_drafts", "Verify steps that checked at least one draft token", registry=registry
        )
        self.num_draft_tokens = Counter(
            "specd_spec_decode_num_draft_tokens", "Draft tokens proposed and verified", registry=registry
        )
        self.num_accepted_tokens = Counter(
            "specd_spec_decode_num_accepted_tokens", "Draft tokens the target accepted", registry=registry
        )
        self.lookup = {  # the lookups' share of the three above (ngram or suffix; the rest: the draft model's)
            name: Counter(
                f"specd_spec_decode_lookup_{name}",
                f"Of specd_spec_decode_{name}, those a lookup guessed (prompt lookup or suffix drafter; no draft call)",
                registry=registry,
            )
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        }
        self.num_accepted_tokens_per_pos = Counter(
            "specd_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first)",
            ["position"],
            registry=registry,
        )
        self.steps = Counter(
            "specd_steps", "Generation steps (speculative or plain decode), each one target pass", registry=registry
        )
        self.step_seconds = Histogram(
            "specd_step_seconds",
            "Seconds of one step by phase: draft (inside the draft service), verify (inside "
            "the target service), network (the rest of both round trips)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ahead_steps = Counter(
            "specd_draft_ahead_steps",
            "Steps that drafted the next step during their verify (ahead.py), by what became of the guesses: ready "
            "(the next step took them, no Propose to wait for) or wasted (not all accepted, or the bonus differed)",
            ["outcome"],
            registry=registry,
        )
        self.ahead_wasted_tokens = Counter(
            "specd_draft_ahead_wasted_tokens",
            "Tokens drafted ahead and never verified (discarded guesses, and each used pre-draft's bonus guess)",
            registry=registry,
        )
        self.ahead_hidden_seconds = Counter(
            "specd_draft_ahead_hidden_seconds",
            "Draft seconds and round trips that guesses drafted ahead spent behind a verify instead of before one",
            registry=registry,
        )
        self.resyncs = Counter(
            "specd_session_resyncs", "Session calls resent after a service disagreed on its cache", registry=registry
        )

    def routed(self, role: str, route: Route) -> None:
        """A new request placed on a replica of the `role` pool (worker.py, router.py)."""
        self.routes.labels(role, route.reason).inc()
        self.route_matched_tokens.labels(role).inc(route.matched_tokens)

    def migrated(self, role: str = "target") -> None:
        """A request moved off a failed `role` replica."""
        self.migrations.labels(role).inc()

    def rejected(self, api: str, outcome: str = "INVALID_ARGUMENT") -> None:
        """A request refused before it started."""
        self.requests.labels(api, outcome).inc()

    async def track(self, api: str, events: AsyncGenerator) -> AsyncGenerator:
        """Pass a request's events through, recording it."""
        arrived = time.perf_counter()
        first_token = None
        outcome = "cancelled"
        self.running.inc()
        try:
            async for event in events:
                now = time.perf_counter()
                if isinstance(event, Delta) and first_token is None and event.token_ids:
                    first_token = now
                    self.time_to_first_token.observe(now - arrived)
                elif isinstance(event, Finished):
                    outcome = event.reason
                    self._finished(event, now - arrived, None if first_token is None else now - first_token)
                elif isinstance(event, Failed):
                    outcome = event.code
                yield event
        finally:
            self.running.dec()
            self.requests.labels(api, outcome).inc()
            await events.aclose()  # a client that left: stop the generation loop now, not at garbage collection

    def _finished(self, event: Finished, e2e: float, after_first_token: float | None) -> None:
        stats = event.stats
        self.e2e_latency.observe(e2e)
        if after_first_token is not None and event.completion_tokens > 1:
            self.time_per_output_token.observe(after_first_token / (event.completion_tokens - 1))
        self.prompt_tokens.inc(event.prompt_tokens)
        self.cached_prompt_tokens.inc(event.cached_prompt_tokens)
        self.generation_tokens.inc(event.completion_tokens)
        self.request_generation_tokens.observe(event.completion_tokens)
        self.num_drafts.inc(stats.drafting_steps)
        self.num_draft_tokens.inc(stats.drafted)
        self.num_accepted_tokens.inc(stats.accepted)
        self.lookup["num_drafts"].inc(stats.lookup_steps)
        self.lookup["num_draft_tokens"].inc(stats.lookup_drafted)
        self.lookup["num_accepted_tokens"].inc(stats.lookup_accepted)
        for position, accepted in enumerate(stats.accepted_per_position):
            self.num_accepted_tokens_per_pos.labels(str(position)).inc(accepted)
        self.steps.inc(stats.steps)
        for draft, verify, network in stats.step_seconds:
            if draft:
                self.step_seconds.labels("draft").observe(draft)
            self.step_seconds.labels("verify").observe(verify)
            self.step_seconds.labels("network").observe(network)
        self.resyncs.inc(stats.resyncs)
        self.ahead_steps.labels("ready").inc(stats.ahead_ready)
        self.ahead_steps.labels("wasted").inc(max(0, stats.ahead_steps - stats.ahead_ready))
        self.ahead_wasted_tokens.inc(stats.ahead_wasted_tokens)
        self.ahead_hidden_seconds.inc(stats.ahead_hidden_seconds)
