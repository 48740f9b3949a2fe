"""The draft engine: sync a session to the committed tokens, then guess K tokens one at a time."""

from dataclasses import dataclass

import torch

from specd.contract import Stream
from specd.model.engine import Engine, check_continuation, check_sampling
from specd.model.sampling import Sampling, draw, probs_from_logits, prune_q
from specd.model.sessions import Cursor


@dataclass
class Proposal:
    draft_tokens: list[int]  # the K guesses
    q: list[tuple[torch.Tensor, torch.Tensor]]  # when sampling: (token ids, probs) per guess
    cached_tokens: int  # session length after the call: committed + first K-1 guesses


class DraftEngine(Engine):
    role = "draft"

    def propose(self, cursor: Cursor, k: int, sampling: Sampling) -> Proposal:
        check_continuation(cursor)
        self.check_draft_length(k)
        check_sampling(sampling)
        session = self.store.sync(cursor, extra_tokens=k - 1)
        first_position = cursor.start + len(cursor.tokens)
        logits = self.store.extend(session, cursor.tokens)[-1]
        draft_tokens, q = [], []
        for i in range(k):
            if i > 0:  # the last guess needs no KV: the next call rolls back to the agreed prefix
                logits = self.store.extend(session, [draft_tokens[-1]])[-1]
            token, q_row = self._guess(logits, sampling, first_position + i)
            draft_tokens.append(token)
            if q_row is not None:
                q.append(q_row)
        return Proposal(draft_tokens, q, len(session.tokens))

    @staticmethod
    def _guess(logits: torch.Tensor, sampling: Sampling, position: int):
        if sampling.greedy:
            return int(logits.argmax()), None
        token_ids, probs = prune_q(probs_from_logits(logits, sampling))
        index = draw(probs, sampling, position, Stream.DRAFT)
        return int(token_ids[index]), (token_ids, probs)
