"""The target engine: score the committed tail plus K drafts in one pass, keep what it agrees with."""

from dataclasses import dataclass

import torch

from specd.model.acceptance import accept_draft
from specd.model.engine import Engine, check_continuation, check_sampling
from specd.model.errors import InvalidRequest
from specd.model.sampling import Sampling, densify, probs_from_logits
from specd.model.sessions import Cursor


@dataclass
class Verification:
    accepted: int  # draft tokens kept
    emitted_tokens: list[int]  # accepted drafts + recovered or bonus token
    logprobs: list[float]  # log p of each emitted token (empty unless asked)
    cached_tokens: int  # session length after the rollback


class TargetEngine(Engine):
    role = "target"

    def verify(
        self,
        cursor: Cursor,
        draft_tokens: list[int],
        q_rows: list[tuple[torch.Tensor, torch.Tensor]],
        sampling: Sampling,
        return_logprobs: bool = False,
    ) -> Verification:
        """One forward pass over cursor.tokens + draft_tokens, the acceptance rule, the rollback.

        With no draft tokens this is a plain decode step (speculation off).
        """
        check_continuation(cursor)
        check_sampling(sampling)
        if draft_tokens:
            self.check_draft_length(len(draft_tokens))
        self.store.check_tokens(draft_tokens, "draft tokens")
        q = None if sampling.greedy else self._dense_q(q_rows, draft_tokens)
        session = self.store.sync(cursor, extra_tokens=len(draft_tokens))
        first_position = cursor.start + len(cursor.tokens)  # where draft_tokens[0] sits
        logits = self.store.extend(session, cursor.tokens + draft_tokens, keep_logits=len(draft_tokens) + 1)
        p = logits if sampling.greedy else probs_from_logits(logits, sampling)
        verdict = accept_draft(draft_tokens, p, q, sampling, first_position)
        self.store.truncate(session, first_position + verdict.accepted)  # the rollback
        logprobs = _logprobs(logits, verdict.emitted) if return_logprobs else []
        return Verification(verdict.accepted, verdict.emitted, logprobs, len(session.tokens))

    def _dense_q(self, q_rows, draft_tokens: list[int]) -> torch.Tensor:
        k = len(draft_tokens)
        if len(q_rows) != k:
            raise InvalidRequest(f"sampling needs one q row per draft token: got {len(q_rows)} for K={k}")
        vocab = self.loaded.vocab_size
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
        return q


def _logprobs(logits: torch.Tensor, emitted: list[int]) -> list[float]:
    """log p (temperature 1) of emitted[i] under row i."""
    rows = torch.log_softmax(logits[: len(emitted)], dim=-1)
    return [float(rows[i, token]) for i, token in enumerate(emitted)]
