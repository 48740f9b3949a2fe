"""The target engine: score the committed tail plus K drafts in one pass, keep what it agrees with.

Concurrent calls share that pass (verify_batch); each keeps its own rule, randomness and rollback.
"""

from dataclasses import dataclass

import torch

from specd.model.acceptance import accept_draft
from specd.model.engine import Row
from specd.model.errors import EngineError, InvalidRequest
from specd.model.sampling import Sampling, densify, probs_from_logits
from specd.model.service import ModelService, check_continuation, check_sampling, open_each, single
from specd.model.sessions import Cursor, Session


@dataclass(frozen=True)
class VerifyCall:
    cursor: Cursor
    draft_tokens: list[int]  # empty: a plain decode step (speculation off)
    q_rows: list[tuple[torch.Tensor, torch.Tensor]]  # when sampling: (token ids, probs) per draft token
    sampling: Sampling
    return_logprobs: bool = False

    @property
    def new_tokens(self) -> int:
        return len(self.cursor.tokens) + len(self.draft_tokens)


@dataclass
class Verification:
    accepted: int  # draft tokens kept
    emitted_tokens: list[int]  # accepted drafts + recovered or bonus token
    logprobs: list[float]  # log p of each emitted token (empty unless asked)
    cached_tokens: int  # session length after the rollback


class Verifier(ModelService):
    role = "target"

    def verify(self, call: VerifyCall) -> Verification:
        return single(self.verify_batch([call]))

    def verify_batch(self, calls: list[VerifyCall]) -> list[Verification | EngineError]:
        """One forward pass over every call's committed tail + drafts, then each call's rule and rollback."""
        results, ready = open_each(calls, self._open)
        rows = [
            Row(call.cursor.session_id, call.cursor.tokens + call.draft_tokens, len(call.draft_tokens) + 1)
            for _, call, _ in ready
        ]
        logits = self.store.forward(rows) if rows else []
        for (index, call, (session, q)), call_logits in zip(ready, logits):
            results[index] = self._judge(call, session, q, call_logits)
        return results

    def _open(self, call: VerifyCall):
        """Every check, then the session synced to the cursor (checks first: a refusal changes nothing)."""
        check_continuation(call.cursor)
        check_sampling(call.sampling)
        if call.draft_tokens:
            self.check_draft_length(len(call.draft_tokens))
        self.store.check_tokens(call.draft_tokens, "draft tokens")
        q = None if call.sampling.greedy else self._dense_q(call.q_rows, call.draft_tokens)
        return self.store.sync(call.cursor, extra_tokens=len(call.draft_tokens)), q

    def _judge(self, call: VerifyCall, session: Session, q, logits: torch.Tensor) -> Verification:
        """The acceptance rule on the target's rows, then the rollback to what it kept."""
        first_position = call.cursor.start + len(call.cursor.tokens)  # where draft_tokens[0] sits
        p = logits if call.sampling.greedy else probs_from_logits(logits, call.sampling)
        verdict = accept_draft(call.draft_tokens, p, q, call.sampling, first_position)
        self.store.truncate(session, first_position + verdict.accepted)  # the rollback
        logprobs = _logprobs(logits, verdict.emitted) if call.return_logprobs else []
        return Verification(verdict.accepted, verdict.emitted, logprobs, len(session.tokens))

    def _dense_q(self, q_rows, draft_tokens: list[int]) -> torch.Tensor:
        k = len(draft_tokens)
        if len(q_rows) != k:
            raise InvalidRequest(f"sampling needs one q row per draft token: got {len(q_rows)} for K={k}")
        vocab = self.engine.description.vocab_size
        rows = []
        for token_ids, probs in q_rows:
            if token_ids.numel() != probs.numel() or token_ids.numel() == 0:
                raise InvalidRequest("each q row needs as many probabilities as token ids, at least one")
            if int(token_ids.max()) >= vocab or not torch.isfinite(probs).all() or (probs < 0).any():
                raise InvalidRequest("q rows must hold in-vocabulary ids and finite, non-negative probabilities")
            rows.append(densify(token_ids, probs, vocab))
        q = torch.stack(rows) if rows else torch.empty(0, vocab)
        if k and (q[torch.arange(k), torch.tensor(draft_tokens)] <= 0).any():
            raise InvalidRequest("every draft token must have q > 0 in its row: it was sampled from q")
        return q.to(self.engine.description.device)  # checked on the host, where it arrived; used beside p


def _logprobs(logits: torch.Tensor, emitted: list[int]) -> list[float]:
    """log p (temperature 1) of emitted[i] under row i (one copy to the host)."""
    rows = torch.log_softmax(logits[: len(emitted)], dim=-1)
    return rows[torch.arange(len(emitted), device=rows.device), torch.tensor(emitted, device=rows.device)].tolist()
