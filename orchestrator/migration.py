"""Moving a request off a failed target replica (issue 40), as NVIDIA Dynamo's `--migration-limit`
does it: the orchestrator holds every token a request has streamed, so when its target replica fails
(UNAVAILABLE past a short retry: dead, cut off, restarting) the pool sends it again to another
serving replica with those tokens (`GenerationRequest.resumed`): a new session there prefills the
prompt and the output so far (from the prefix cache where that replica has the prompt) and the
generation goes on from the next position. The client's stream just continues. Greedy, the moved
request emits the tokens it would have emitted; sampled, the target's draws are keyed by the seed
and the position (docs/architecture.md §3), so with speculation off it emits them too, and while
speculating (which draws are made depends on the guesses) it keeps the exact distribution.

`Progress`, one per request: the tokens streamed so far and the moves made, and whether a failure
moves it (`moves_on`): a target's UNAVAILABLE with another replica serving, or the death of the Ray
worker actor that ran it, fewer than `limit` moves made, time left. Where another replica serves,
the request gives a failing target up after the policy's `failover_retry_s` of retries and a frozen
one after its step deadline (faults.py), not after the 30 s and 300 s a lone target gets. `Rejoin`,
one per pool: a replica that failed (a target, or a draft a request left, generation.py) takes no
new request until its health says SERVING again; then it rejoins, empty, and the sessions the
requests that left it held there are released (a frozen replica that thaws still holds them).
"""

import asyncio
import contextlib
import logging
import time

from specd.orchestrator.remote import release_sessions, wait_until_serving
from specd.orchestrator.request import Delta, Failed, GenerationRequest
from specd.orchestrator.router import Router
from specd.proto.auth import ClientSecurity

MIGRATION_LIMIT = 3  # moves per request (--migration-limit); 0: a failed target fails its requests
REJOIN_CHECK_S = 3600.0  # one wait for a failed replica's SERVING; then the next

log = logging.getLogger("specd.orchestrator")


class Progress:
    """One request across its attempts: what it streamed, and how often it moved."""

    def __init__(self, request: GenerationRequest, limit: int = MIGRATION_LIMIT):
        self.request = request
        self.limit = limit
        self.tokens: list[int] = []  # output tokens streamed to the client so far
        self.moves = 0

    def streamed(self, event) -> None:
        if isinstance(event, Delta):
            self.tokens.extend(event.token_ids)

    def moves_on(self, event: Failed, others: bool) -> bool:
        """Whether this failure moves the request: its target replica failed and another serves
        (`others`), or the orchestrator worker running it died (another worker, or the same one once
        Ray restarted it, takes it over on the same replicas)."""
        deadline = self.request.deadline
        return (
            ((event.service == "target" and others) or event.service == "worker")
            and event.code == "UNAVAILABLE"
            and self.moves < self.limit
            and (deadline is None or deadline > time.time())
        )


class Rejoin:
    """Failed replicas out of their role's router until they serve again."""

    def __init__(self, routers: dict[str, Router], security: ClientSecurity = ClientSecurity()):
        self.routers = routers  # per role ("target", "draft")
        self.security = security
        self.waiting: dict[tuple[str, str], asyncio.Task] = {}
        self.left: dict[tuple[str, str], list[str]] = {}  # sessions that requests left there, to release

    def failed(self, role: str, name: str, session_id: str) -> None:
        """Replica `name` of `role` failed the request with this session (which went elsewhere)."""
        self.routers[role].failed(name)
        self.left.setdefault((role, name), []).append(session_id)
        if (role, name) not in self.waiting:
            self.waiting[role, name] = asyncio.create_task(self._rejoin(role, name))

    async def _rejoin(self, role: str, name: str) -> None:
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await wait_until_serving(name, REJOIN_CHECK_S, self.security)
                    break
            await release_sessions(role, name, self.left.pop((role, name), []), self.security)
            self.routers[role].back(name)
            log.info("%s replica %s serves again: it rejoins the pool", role, name)
        finally:
            self.waiting.pop((role, name), None)

    def close(self) -> None:
        for task in list(self.waiting.values()):
            task.cancel()
